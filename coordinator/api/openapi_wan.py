"""OpenAPI paths of the WAN surfaces: resumable uploads, probes, relays and placement (docs/wan.md)."""
from __future__ import annotations

from typing import Any

from coordinator.api.openapi_parts import (BAD_REQUEST, EXPERT_NAME, NAME_PATTERN, NOT_FOUND, STORAGE_FULL,
                                           TENSOR_BODY, WORKER_ID, bytes_response, error_response, header_param, json_response, path_param,
                                           query_param, schema_ref)

UPLOAD_ID = path_param("upload_id", "^[0-9a-f]{32}$", "0" * 32, "The id POST /experts/{name}/uploads returned.")
UPLOAD_STATUS = {
    "type": "object", "required": ["upload_id", "update_id", "offset", "size", "complete", "expires_at"],
    "properties": {"upload_id": {"type": ["string", "null"]}, "update_id": {"type": "string"},
                   "expert": {"type": "string"},
                   "offset": {"type": "integer", "description": "Bytes received and durable: send from here."},
                   "size": {"type": "integer"}, "complete": {"type": "boolean"},
                   "expires_at": {"type": "number", "description": "Unix time it expires if no chunk comes."},
                   "chunk_limit": {"type": "integer", "description": "Largest chunk accepted (--max-body-mb)."},
                   "prefix_digests": {"type": "boolean", "description": "Chunks may be checked by "
                                      "X-FedMoE-Upload-Digest (answer to an open)."},
                   "update": schema_ref("UpdateStatus")}}
OFFSET_HEADERS = {"X-FedMoE-Upload-Offset": {"description": "The offset.", "schema": {"type": "string"}}}
UNKNOWN_UPLOAD = error_response("No such expert, or no open upload of that id for this caller (finished, expired, "
                        "another worker's, or never opened).")
UPLOAD_PATHS: dict[str, Any] = {  # resumable pushes (coordinator/api/uploads.py, docs/wan.md)
    "/experts/{name}/uploads": {"post": {
        "operationId": "openUpload", "summary": "Open a resumable push of a large update (or find the open one "
                                                "of this update_id, with its offset).",
        "parameters": [EXPERT_NAME],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["update", "size", "digest"],
            "properties": {"update": schema_ref("UpdateMeta"), "size": {"type": "integer", "minimum": 1},
                           "digest": {"type": "string", "pattern": "^sha256=[0-9a-f]{64}$"}}}}}},
        "responses": {"201": json_response(UPLOAD_STATUS, "Opened at offset 0."),
                      "200": json_response(UPLOAD_STATUS, "Already open (offset says where to continue), or the update "
                                                  "is already recorded (``update``, nothing to send)."),
                      "400": BAD_REQUEST, "404": NOT_FOUND,
                      "409": error_response("update_id already open or recorded with another body, size or expert."),
                      "413": error_response("size over --max-body-mb."), "507": STORAGE_FULL}}},
    "/experts/{name}/uploads/{upload_id}": {
        "get": {"operationId": "uploadStatus", "summary": "Where an upload stands (HEAD: the offset header only).",
                "parameters": [EXPERT_NAME, UPLOAD_ID],
                "responses": {"200": json_response(UPLOAD_STATUS, "The upload.") | {"headers": OFFSET_HEADERS},
                              "404": UNKNOWN_UPLOAD}},
        "put": {"operationId": "uploadChunk", "summary": "Append a chunk at the offset; 200 once it is durable.",
                "parameters": [EXPERT_NAME, UPLOAD_ID,
                               header_param("Content-Range", "bytes <start>-<end>/<size>; start must be the offset.",
                                       required=True),
                               header_param("X-FedMoE-Digest", "blake3=<hex> or sha256=<hex> of this chunk (optional)."),
                               header_param("X-FedMoE-Upload-Digest", "the digest of the body's bytes 0 to this chunk's "
                                       "end, in the upload's algorithm (optional; hashes nothing twice).")],
                "requestBody": TENSOR_BODY | {"description": "The chunk's bytes."},
                "responses": {"200": json_response(UPLOAD_STATUS, "Stored; the new offset."), "400": BAD_REQUEST,
                              "404": UNKNOWN_UPLOAD,
                              "409": error_response("The chunk overlaps bytes already received (details.offset)."),
                              "413": error_response("Chunk over --max-body-mb."),
                              "416": error_response("The chunk leaves a gap after the offset or ends past the size "
                                            "(details.offset)."),
                              "507": STORAGE_FULL}},
        "delete": {"operationId": "abandonUpload", "summary": "Drop an upload and its bytes.",
                   "parameters": [EXPERT_NAME, UPLOAD_ID],
                   "responses": {"204": {"description": "Dropped."}, "404": UNKNOWN_UPLOAD}}},
    "/experts/{name}/uploads/{upload_id}/complete": {"post": {
        "operationId": "completeUpload", "summary": "Check size and digest, then push it as POST .../updates "
                                                    "would: 202 recorded, 200 seen before (a retry).",
        "parameters": [EXPERT_NAME, UPLOAD_ID],
        "responses": {"202": json_response(schema_ref("UpdateStatus"), "Recorded on disk (and maybe applied)."),
                      "200": json_response(schema_ref("UpdateStatus"), "Finished before, or the update_id was seen before."),
                      "400": BAD_REQUEST, "404": UNKNOWN_UPLOAD,
                      "409": error_response("Bytes missing (details.offset), or the push's own conflicts."),
                      "422": error_response("The bytes do not match the digest (the upload is dropped), or the push's "
                                    "own checks refused the update."),
                      "507": STORAGE_FULL}}},
}

RELAY_PATHS: dict[str, Any] = {  # coordinator/api/relays.py; docs/history/wan.md, "Relays"
    "/probe": {"get": {
        "operationId": "probe", "summary": "Public: N zero bytes, for clients measuring throughput (protocol/probe.py).",
        "security": [],
        "parameters": [query_param("bytes", {"type": "integer", "minimum": 0, "maximum": 4 << 20}, "Bytes to send.")],
        "responses": {"200": bytes_response("Zero bytes."), "400": BAD_REQUEST}},
        "post": {
            "operationId": "probeUpload",
            "summary": "Up to 4 MiB, read and dropped: a worker times it to size its first --compression auto push.",
            "requestBody": TENSOR_BODY,  # any bytes, at most 4 MiB (a maxLength here starves the fuzzer's generator)
            "responses": {"200": json_response({"type": "object", "required": ["bytes"],
                                        "properties": {"bytes": {"type": "integer"}}}, "Bytes received."),
                          "413": error_response("Body over 4 MiB.")}}},
    "/relays": {
        "get": {"operationId": "listRelays",
                "summary": "The tree below this root: relays, their workers and bytes saved (workers probe the URLs).",
                "responses": {"200": json_response({"type": "object", "required": ["relays"],
                                            "properties": {"relays": {"type": "array", "items": {"type": "object"}}}},
                                           "Relays that registered or reported since this root started.")}},
        "post": {"operationId": "registerRelay",
                 "summary": "A relay joins with the join token (or renews with its own) and gets a relay token.",
                 "requestBody": {"required": True, "content": {"application/json": {"schema": {
                     "type": "object", "required": ["relay_id"],
                     "properties": {"relay_id": {"type": "string", "pattern": NAME_PATTERN},
                                    "url": {"type": ["string", "null"], "maxLength": 512},
                                    "base_model": {"oneOf": [schema_ref("BaseModel"), {"type": "null"}]}}}}}},
                 "responses": {"200": json_response({"type": "object", "required": ["relay_id", "experts"]},
                                            "Registered; ``token`` is the relay's token when auth is on; ``limits`` "
                                            "the root's --server-lr and --norm-* settings, which the relay "
                                            "applies to its workers' updates before acknowledging them."),
                               "400": BAD_REQUEST,
                               "403": error_response("The relay id is active, or the token may not register relays."),
                               "409": error_response("The relay's base model differs from an expert's."),
                               "413": error_response("JSON body over 1 MiB.")}}},
    "/experts/{name}/dp-cohorts": {"post": {
        "operationId": "bookDPCohort",
        "summary": "A relay (relay token) books one of its DP cohorts' steps before unmasking it; once per cohort.",
        "parameters": [EXPERT_NAME],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema_ref("DPCohortSum")}}},
        "responses": {"200": json_response({"type": "object", "required": ["cohort", "booked"]}, "Booked (or already)."),
                      "400": BAD_REQUEST, "403": error_response("Not a relay's token."), "404": error_response("No such expert."),
                      "409": error_response("privacy_budget_spent; dp_cohort_mismatch (sigma or C not this root's); "
                                    "dp_relay_batch (this root does not run DP with secure aggregation)."),
                      "413": error_response("JSON body over 1 MiB.")}}},
    "/relays/{relay_id}/report": {"post": {
        "operationId": "relayReport", "summary": "A relay reports its workers and byte counters.",
        "parameters": [path_param("relay_id", NAME_PATTERN, "site-a", "The relay's id.")],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"workers": {"type": "array", "items": {"type": "object"}},
                                             "stats": {"type": "object"}}}}}},
        "responses": {"200": json_response({"type": "object"}, "Noted."), "400": BAD_REQUEST,
                      "403": error_response("Not this relay's token."), "413": error_response("JSON body over 1 MiB.")}}},
    # coordinator/api/placement.py; docs/wan.md, "A hierarchy that forms itself"
    "/workers/{worker_id}/probes": {"post": {
        "operationId": "reportProbes",
        "summary": "A worker's measured links (RTT ms, Mbit/s; null: unreachable) to the root and the relays it was "
                   "listed; the answer is where it should sync.",
        "parameters": [WORKER_ID],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["links"],
            "properties": {"links": {"type": "object", "maxProperties": 1000, "additionalProperties": {
                "type": "object", "properties": {"rtt_ms": {"type": ["number", "null"], "minimum": 0},
                                                 "mbps": {"type": ["number", "null"], "minimum": 0}}}}}}}}},
        "responses": {"200": json_response({"type": "object", "required": ["relay_id", "generation", "planned"]},
                                   "The worker's assignment: a relay id, or null for the root."),
                      "400": BAD_REQUEST, "403": error_response("Not this worker's token."),
                      "404": error_response("No such worker registered here.")}}},
    "/placement": {"get": {
        "operationId": "placement", "summary": "The root's plan: its generation and groups, each with its relay.",
        "responses": {"200": json_response({"type": "object", "required": ["generation", "groups"]}, "The plan.")}}},
}
