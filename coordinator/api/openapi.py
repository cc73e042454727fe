"""OpenAPI 3 description of the coordinator's HTTP API, served at GET /api/v1/openapi.json.

Written by hand as a plain dict so it reads like documentation and stays free of a framework.
Tensor bodies are raw bytes (safetensors or a compression payload) with their JSON metadata in
one header; every error is the JSON object ``Error``. tests/e2e/test_openapi_fuzz.py fuzzes a live
server from this description with schemathesis, and tests/coordinator/test_openapi.py checks
that it names every route the app has.
"""
from __future__ import annotations

from typing import Any

from protocol.profiles import DEFAULT_DIM, DEFAULT_NGRAMS
from protocol.schemas import (API_PREFIX, EXPERT_HEADER, MAX_BATCH_MEMBERS, MAX_COUNT, UPDATE_HEADER, VERSION_HEADER,
                              WORKER_HEADER)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
UPDATE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
EXAMPLE_EXPERT = "python_expert"  # tests seed an expert of this name so examples reach real data


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


def _bytes(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description,
                                "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                    "format": "binary"}}}}
    if headers:
        response["headers"] = headers
    return response


def _path_param(name: str, pattern: str, example: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string", "pattern": pattern}, "example": example}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def _header(name: str, description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": required, "description": description,
            "schema": {"type": "string"}}


def _json_param(name: str, where: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A parameter holding a JSON document (the metadata headers, codec_config)."""
    return {"name": name, "in": where, "required": where == "header", "description": description,
            "content": {"application/json": {"schema": schema}}}


EXPERT_NAME = _path_param("name", NAME_PATTERN, EXAMPLE_EXPERT, "Expert name (the workers' --specialty).")
WORKER_ID = _path_param("worker_id", NAME_PATTERN, "worker-1", "Worker id.")
UPDATE_ID = _path_param("update_id", UPDATE_ID_PATTERN, "worker-1:0001", "The update_id a worker chose.")
VERSION_HEADERS = {VERSION_HEADER: {"description": "Expert version of the body.", "schema": {"type": "string"}}}
VERSION_QUERY = {"type": "string", "pattern": "^[0-9]{1,18}$"}  # ASCII digits within SQLite's 64-bit integers
TENSOR_BODY = {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}
BAD_REQUEST = _error("Malformed request: a field, header, query parameter or body is wrong.")
NOT_FOUND = _error("No such expert, version, worker or update.")
STORAGE_FULL = _error("The coordinator's disk is full: nothing was recorded; retry once space is freed.")

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["code", "message"],
            "properties": {"code": {"type": "string", "description": "Stable code a program matches on."},
                           "message": {"type": "string", "description": "What went wrong and what to do."},
                           "details": {"type": "object"}}}},
    },
    "BaseModel": {
        "type": "object", "required": ["id", "fingerprint"],
        "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 256},
                       "fingerprint": {"type": "string", "pattern": "^[0-9a-f]{16,128}$"}},
    },
    "Lora": {
        "type": "object", "required": ["rank", "alpha", "target_modules"],
        "properties": {"rank": {"type": "integer", "minimum": 1}, "alpha": {"type": "number", "exclusiveMinimum": 0},
                       "target_modules": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}},
    },
    "ExpertSpec": {
        "type": "object", "required": ["lora", "base_model"],
        "description": f"JSON in the {EXPERT_HEADER} header of PUT /experts/{{name}}.",
        "properties": {"lora": _ref("Lora"), "base_model": _ref("BaseModel"),
                       "worker_id": {"type": "string", "pattern": NAME_PATTERN}},
    },
    "UpdateMeta": {
        "type": "object", "required": ["update_id", "base_version", "num_samples"],
        "description": f"JSON in the {UPDATE_HEADER} header of POST /experts/{{name}}/updates.",
        "properties": {"update_id": {"type": "string", "pattern": UPDATE_ID_PATTERN},
                       "base_version": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT},
                       "num_samples": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT},
                       "train_loss": {"type": ["number", "null"]},
                       "codec": {"type": "string", "minLength": 1, "default": "safetensors"},
                       "codec_config": {"type": "object"},
                       "worker_id": {"type": "string", "pattern": NAME_PATTERN},
                       "members": {"type": "object", "minProperties": 1, "maxProperties": MAX_BATCH_MEMBERS,
                                   "additionalProperties": {"type": "string"},
                                   "description": "A relay's combined update only (relay or admin token): worker "
                                                  "update id -> content id of its body. 409 (reason "
                                                  "members_applied, details.members) if the root has one."},
                       "dp_cohort": _ref("DPCohortSum")},
    },
    "DPCohortSum": {
        "type": "object", "required": ["cohort", "members", "survivors", "noise_multiplier", "clip_norm"],
        "description": "A relay's batch that is one DP cohort's unmasked sum (its one member is ``cohort``).",
        "properties": {"cohort": {"type": "string", "minLength": 1, "maxLength": 128},
                       "members": {"type": "integer", "minimum": 2, "maximum": 1024},
                       "survivors": {"type": "integer", "minimum": 1, "maximum": 1024},
                       "noise_multiplier": {"type": "number", "exclusiveMinimum": 0},
                       "clip_norm": {"type": "number", "exclusiveMinimum": 0}},
        "additionalProperties": False,
    },
    "Expert": {
        "type": "object", "required": ["name", "version", "updates_applied", "samples_seen", "pending_updates"],
        "properties": {"name": {"type": "string"}, "version": {"type": "integer"},
                       "lora": _ref("Lora"), "base_model": _ref("BaseModel"),
                       "updates_applied": {"type": "integer"}, "samples_seen": {"type": "integer"},
                       "pending_updates": {"type": "integer"},
                       "last_train_loss": {"type": ["number", "null"]},
                       "created_at": {"type": "number"}, "updated_at": {"type": "number"}},
    },
    "UpdateStatus": {
        "type": "object", "required": ["update_id", "expert", "status", "expert_version"],
        "properties": {"update_id": {"type": "string"}, "expert": {"type": "string"},
                       "status": {"type": "string", "enum": ["pending", "applied", "quarantined"]},
                       "applied_version": {"type": ["integer", "null"]},
                       "expert_version": {"type": ["integer", "null"],
                                          "description": "null: the expert was set aside (quarantined)"}},
    },
    "Worker": {
        "type": "object", "required": ["worker_id", "specialty", "status"],
        "properties": {"worker_id": {"type": "string"}, "specialty": {"type": "string"},
                       "status": {"type": "string", "enum": ["alive", "stale", "gone"]}},
    },
    "Profile": {
        "type": "object", "required": ["format", "version", "dim", "ngrams", "num_examples", "vector"],
        "description": "A worker's n-gram summary of its data (protocol.profiles.profile_to_json).",
        "properties": {"format": {"type": "string", "enum": ["fedmoe-profile"]},
                       "version": {"type": "integer", "enum": [1]},
                       "dim": {"type": "integer", "enum": [DEFAULT_DIM]},
                       "ngrams": {"type": "array", "items": {"type": "integer"}, "const": list(DEFAULT_NGRAMS)},
                       "num_examples": {"type": "integer", "minimum": 1},
                       "vector": {"type": "array", "items": {"type": "number"}, "minItems": DEFAULT_DIM,
                                  "maxItems": DEFAULT_DIM}},
    },
    "Gateway": {
        "type": "object", "required": ["version", "strategy", "weights", "sources", "digest"],
        "properties": {"version": {"type": "integer"}, "strategy": {"type": "string"},
                       "weights": {"type": "object", "additionalProperties": {"type": "number"}},
                       "sources": {"type": "object", "additionalProperties": {"type": "integer"}},
                       "digest": {"type": "string"},
                       "stale": {"type": "boolean", "description": "An expert changed since this gateway was "
                                 "built; a newer one follows within --gateway-interval seconds."}},
    },
}

_api: dict[str, Any] = {
    "/health": {"get": {
        "operationId": "health", "summary": "Liveness and the number of experts.",
        "responses": {"200": _json({"type": "object", "required": ["status", "experts", "store"],
                                    "properties": {"status": {"type": "string"}, "experts": {"type": "integer"},
                                                   "store": {"type": "string", "enum": ["ok", "slow", "unavailable"],
                                                             "description": "ok: experts was read just now; "
                                                             "slow or unavailable: the last count read, the "
                                                             "store did not answer within 0.5 s or failed."}}},
                                   "The coordinator is up.")}}},
    "/openapi.json": {"get": {
        "operationId": "openapi", "summary": "This description.",
        "responses": {"200": _json({"type": "object"}, "OpenAPI 3 document.")}}},
    "/workers": {
        "get": {"operationId": "listWorkers", "summary": "Registered workers with their liveness.",
                "responses": {"200": _json({"type": "object", "required": ["workers"],
                                            "properties": {"workers": {"type": "array", "items": _ref("Worker")}}},
                                           "All workers.")}},
        "post": {"operationId": "registerWorker",
                 "summary": "Register a worker; with its own (even expired) token, renew it (docs/identity.md).",
                 "requestBody": {"required": True, "content": {"application/json": {"schema": {
                     "type": "object", "required": ["worker_id", "specialty", "base_model"],
                     "properties": {"worker_id": {"type": "string", "pattern": NAME_PATTERN},
                                    "specialty": {"type": "string", "pattern": NAME_PATTERN},
                                    "base_model": _ref("BaseModel"),
                                    "sync_interval": {"type": ["number", "null"], "exclusiveMinimum": 0}}}}}},
                 "responses": {"200": _json({"type": "object", "required": ["worker_id", "specialty", "expert"]},
                                            "Registered; ``expert`` is the expert's info or null."),
                               "400": BAD_REQUEST,
                               "403": _error("The worker id is active (needs its own token or admin), revoked, "
                                             "or the token is another worker's."),
                               "409": _error("The worker's base model differs from the expert's."),
                               "413": _error("JSON body over 1 MiB.")}},
    },
    "/workers/{worker_id}": {"delete": {
        "operationId": "revokeWorker", "summary": "Admin: revoke a worker's tokens; its id cannot register again.",
        "parameters": [WORKER_ID],
        "responses": {"200": _json({"type": "object", "required": ["worker_id", "revoked"]}, "Revoked."),
                      "400": BAD_REQUEST, "401": _error("Missing or invalid token."),
                      "403": _error("Not an admin token.")}}},
    "/workers/{worker_id}/heartbeat": {"post": {
        "operationId": "heartbeat", "summary": "A worker says it is alive.", "parameters": [WORKER_ID],
        "responses": {"200": _json({"type": "object"}, "Noted."), "404": NOT_FOUND}}},
    "/experts": {"get": {
        "operationId": "listExperts", "summary": "Every expert with its version and counters.",
        "responses": {"200": _json({"type": "object", "required": ["experts"],
                                    "properties": {"experts": {"type": "array", "items": _ref("Expert")}}},
                                   "All experts.")}}},
    "/experts/{name}": {
        "get": {"operationId": "expertInfo", "summary": "One expert and its stored versions.",
                "parameters": [EXPERT_NAME],
                "responses": {"200": _json(_ref("Expert"), "The expert."), "404": NOT_FOUND}},
        "put": {"operationId": "createExpert", "summary": "Create an expert from its first LoRA adapter.",
                "parameters": [EXPERT_NAME,
                               _json_param(EXPERT_HEADER, "header", _ref("ExpertSpec"), "The expert's setup.")],
                "requestBody": TENSOR_BODY | {"description": "The initial adapter as a safetensors file."},
                "responses": {"200": _json(_ref("Expert"), "It existed with the same setup."),
                              "201": _json(_ref("Expert"), "Created."), "400": BAD_REQUEST,
                              "409": _error("It exists with a different setup."),
                              "413": _error("Body over --max-body-mb."),
                              "422": _error("The tensors are not a LoRA adapter of that spec."),
                              "507": STORAGE_FULL}},
    },
    "/experts/{name}/weights": {"get": {
        "operationId": "expertWeights",
        "summary": "Full weights (safetensors), or with since= the compressed difference from that version.",
        "parameters": [EXPERT_NAME,
                       _query("version", VERSION_QUERY, "Version (default: current)."),
                       _query("since", VERSION_QUERY, "Send that version minus this one."),
                       _query("codec", {"type": "string"}, "Codec of the difference (default fp16)."),
                       _json_param("codec_config", "query", {"type": "object"}, "Codec options as a JSON object."),
                       _header("If-None-Match", "ETag held by the caller."),
                       _header(WORKER_HEADER, "Worker id, to count bytes per worker; with a worker token, "
                                              "it must be the token's (the token's worker is counted anyway).")],
        "responses": {"200": _bytes("Weights or difference.", VERSION_HEADERS),
                      "304": {"description": "Unchanged since the ETag or version held."},
                      "400": BAD_REQUEST, "403": _error("X-FedMoE-Worker names another worker than the token's."),
                      "404": _error("No such expert or version; or no difference can be served (version pruned, "
                                    "the expert kept changing, or it does not fit the codec, e.g. fp16's range; "
                                    "details.reason): pull full weights."),
                      "409": _error("The expert kept changing while its full weights were opened: pull again.")}}},
    "/experts/{name}/updates": {"post": {
        "operationId": "pushUpdate", "summary": "Push a compressed delta; 202 once durable, 200 for a retry.",
        "parameters": [EXPERT_NAME, _json_param(UPDATE_HEADER, "header", _ref("UpdateMeta"), "The update's metadata.")],
        "requestBody": TENSOR_BODY | {"description": "Delta as safetensors, or a compression payload."},
        "responses": {"202": _json(_ref("UpdateStatus"), "Recorded on disk (and maybe applied)."),
                      "200": _json(_ref("UpdateStatus"), "The same update_id and bytes were seen before."),
                      "400": BAD_REQUEST, "404": NOT_FOUND,
                      "409": _error("update_id reused with other bytes or expert, or base_version ahead."),
                      "413": _error("Body over --max-body-mb."),
                      "422": _error("Tensors do not fit the expert (names, shapes, dtype, NaN/Inf), the "
                                    "update's norm is over the limit (--norm-check reject), or applying it would "
                                    "overflow float32 (details.reason result_not_finite); nothing was recorded."),
                      "507": STORAGE_FULL}}},
    "/events": {"get": {
        "operationId": "listEvents", "summary": "The audit log, newest first: creations, registrations, updates "
                                                "accepted/duplicate/rejected/clipped, versions applied.",
        "parameters": [_query("limit", {"type": "integer", "minimum": 1, "maximum": 500}, "Events to return (50)."),
                       _query("after", {"type": "integer", "minimum": 0}, "Only events with a larger id."),
                       _query("expert", {"type": "string"}, "Only this expert's events."),
                       _query("kind", {"type": "string"}, "Only events of this kind.")],
        "responses": {"200": _json({"type": "object", "required": ["events"], "properties": {
            "events": {"type": "array", "items": {"type": "object", "required": ["id", "time", "kind", "message"]}}}},
            "Events."), "400": BAD_REQUEST}}},
    "/updates/{update_id}": {"get": {
        "operationId": "updateStatus", "summary": "Whether an update is pending or applied.",
        "parameters": [UPDATE_ID],
        "responses": {"200": _json(_ref("UpdateStatus"), "Known update."), "404": NOT_FOUND}}},
    "/experts/{name}/profiles/{worker_id}": {"put": {
        "operationId": "putProfile", "summary": "Store a worker's data profile for routing.",
        "parameters": [EXPERT_NAME, WORKER_ID],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("Profile")}}},
        "responses": {"200": _json({"type": "object"}, "Stored."), "400": BAD_REQUEST, "404": NOT_FOUND,
                      "413": _error("JSON body over 1 MiB.")}}},
    "/profiles": {"get": {
        "operationId": "listProfiles", "summary": "Every expert's combined routing profile and the threshold.",
        "responses": {"200": _json({"type": "object", "required": ["threshold", "profiles"], "properties": {
            "threshold": {"type": "number"}, "profiles": {"type": "object"}}}, "Profiles by expert.")}}},
    "/route": {"post": {
        "operationId": "route", "summary": "Pick the expert for a prompt, or the gateway when unsure.",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["prompt"],
            "properties": {"prompt": {"type": "string", "minLength": 1},
                           "threshold": {"type": "number", "minimum": 0, "maximum": 1},
                           "expected": {"type": "string", "description": "The expert the caller knows the prompt "
                                        "belongs to (an evaluation): the answer and /metrics then say whether the "
                                        "route was right, a wrong expert or a fallback to the gateway."}}}}}},
        "responses": {"200": _json({"type": "object", "required": ["target"]}, "The choice and its scores."),
                      "400": BAD_REQUEST, "404": _error("No expert has a routing profile yet."),
                      "413": _error("JSON body over 64 KiB (only the first 8192 characters of a prompt are read).")}}},
    "/gateway": {"get": {
        "operationId": "gatewayInfo", "summary": "The newest gateway built from the experts (rebuilt in the background).",
        "parameters": [_query("fresh", {"type": "string", "enum": ["0", "1"]},
                              "1: build from the experts as they are now (at once) and wait for it.")],
        "responses": {"200": _json(_ref("Gateway"), "Gateway info."), "404": _error("No expert yet."),
                      "409": _error("The experts cannot be merged."),
                      "503": _error("The first gateway is still being built; retry after Retry-After.")}}},
    "/gateway/weights": {"get": {
        "operationId": "gatewayWeights", "summary": "The gateway adapter as safetensors or npz.",
        "parameters": [_query("format", {"type": "string", "enum": ["safetensors", "npz"]}, "File format."),
                       _query("fresh", {"type": "string", "enum": ["0", "1"]},
                              "1: build from the experts as they are now (at once) and wait for it."),
                       _header("If-None-Match", "ETag held by the caller.")],
        "responses": {"200": _bytes("The gateway adapter.", VERSION_HEADERS),
                      "304": {"description": "Unchanged since the ETag held."},
                      "400": BAD_REQUEST, "404": _error("No expert yet."),
                      "409": _error("The experts cannot be merged."),
                      "503": _error("The first gateway is still being built; retry after Retry-After.")}}},
}

UPLOAD_ID = _path_param("upload_id", "^[0-9a-f]{32}$", "0" * 32, "The id POST /experts/{name}/uploads returned.")
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
                   "update": _ref("UpdateStatus")}}
OFFSET_HEADERS = {"X-FedMoE-Upload-Offset": {"description": "The offset.", "schema": {"type": "string"}}}
UNKNOWN_UPLOAD = _error("No such expert, or no open upload of that id for this caller (finished, expired, "
                        "another worker's, or never opened).")
_api.update({  # resumable pushes (coordinator/api/uploads.py, docs/wan.md)
    "/experts/{name}/uploads": {"post": {
        "operationId": "openUpload", "summary": "Open a resumable push of a large update (or find the open one "
                                                "of this update_id, with its offset).",
        "parameters": [EXPERT_NAME],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["update", "size", "digest"],
            "properties": {"update": _ref("UpdateMeta"), "size": {"type": "integer", "minimum": 1},
                           "digest": {"type": "string", "pattern": "^sha256=[0-9a-f]{64}$"}}}}}},
        "responses": {"201": _json(UPLOAD_STATUS, "Opened at offset 0."),
                      "200": _json(UPLOAD_STATUS, "Already open (offset says where to continue), or the update "
                                                  "is already recorded (``update``, nothing to send)."),
                      "400": BAD_REQUEST, "404": NOT_FOUND,
                      "409": _error("update_id already open or recorded with another body, size or expert."),
                      "413": _error("size over --max-body-mb."), "507": STORAGE_FULL}}},
    "/experts/{name}/uploads/{upload_id}": {
        "get": {"operationId": "uploadStatus", "summary": "Where an upload stands (HEAD: the offset header only).",
                "parameters": [EXPERT_NAME, UPLOAD_ID],
                "responses": {"200": _json(UPLOAD_STATUS, "The upload.") | {"headers": OFFSET_HEADERS},
                              "404": UNKNOWN_UPLOAD}},
        "put": {"operationId": "uploadChunk", "summary": "Append a chunk at the offset; 200 once it is durable.",
                "parameters": [EXPERT_NAME, UPLOAD_ID,
                               _header("Content-Range", "bytes <start>-<end>/<size>; start must be the offset.",
                                       required=True),
                               _header("X-FedMoE-Digest", "blake3=<hex> or sha256=<hex> of this chunk (optional)."),
                               _header("X-FedMoE-Upload-Digest", "the digest of the body's bytes 0 to this chunk's "
                                       "end, in the upload's algorithm (optional; hashes nothing twice).")],
                "requestBody": TENSOR_BODY | {"description": "The chunk's bytes."},
                "responses": {"200": _json(UPLOAD_STATUS, "Stored; the new offset."), "400": BAD_REQUEST,
                              "404": UNKNOWN_UPLOAD,
                              "409": _error("The chunk overlaps bytes already received (details.offset)."),
                              "413": _error("Chunk over --max-body-mb."),
                              "416": _error("The chunk leaves a gap after the offset or ends past the size "
                                            "(details.offset)."),
                              "507": STORAGE_FULL}},
        "delete": {"operationId": "abandonUpload", "summary": "Drop an upload and its bytes.",
                   "parameters": [EXPERT_NAME, UPLOAD_ID],
                   "responses": {"204": {"description": "Dropped."}, "404": UNKNOWN_UPLOAD}}},
    "/experts/{name}/uploads/{upload_id}/complete": {"post": {
        "operationId": "completeUpload", "summary": "Check size and digest, then push it as POST .../updates "
                                                    "would: 202 recorded, 200 seen before (a retry).",
        "parameters": [EXPERT_NAME, UPLOAD_ID],
        "responses": {"202": _json(_ref("UpdateStatus"), "Recorded on disk (and maybe applied)."),
                      "200": _json(_ref("UpdateStatus"), "Finished before, or the update_id was seen before."),
                      "400": BAD_REQUEST, "404": UNKNOWN_UPLOAD,
                      "409": _error("Bytes missing (details.offset), or the push's own conflicts."),
                      "422": _error("The bytes do not match the digest (the upload is dropped), or the push's "
                                    "own checks refused the update."),
                      "507": STORAGE_FULL}}},
})
_relays: dict[str, Any] = {  # coordinator/api/relays.py; docs/history/wan.md, "Relays"
    "/probe": {"get": {
        "operationId": "probe", "summary": "Public: N zero bytes, for clients measuring throughput (protocol/probe.py).",
        "security": [],
        "parameters": [_query("bytes", {"type": "integer", "minimum": 0, "maximum": 4 << 20}, "Bytes to send.")],
        "responses": {"200": _bytes("Zero bytes."), "400": BAD_REQUEST}},
        "post": {
            "operationId": "probeUpload",
            "summary": "Up to 4 MiB, read and dropped: a worker times it to size its first --compression auto push.",
            "requestBody": TENSOR_BODY,  # any bytes, at most 4 MiB (a maxLength here starves the fuzzer's generator)
            "responses": {"200": _json({"type": "object", "required": ["bytes"],
                                        "properties": {"bytes": {"type": "integer"}}}, "Bytes received."),
                          "413": _error("Body over 4 MiB.")}}},
    "/relays": {
        "get": {"operationId": "listRelays",
                "summary": "The tree below this root: relays, their workers and bytes saved (workers probe the URLs).",
                "responses": {"200": _json({"type": "object", "required": ["relays"],
                                            "properties": {"relays": {"type": "array", "items": {"type": "object"}}}},
                                           "Relays that registered or reported since this root started.")}},
        "post": {"operationId": "registerRelay",
                 "summary": "A relay joins with the join token (or renews with its own) and gets a relay token.",
                 "requestBody": {"required": True, "content": {"application/json": {"schema": {
                     "type": "object", "required": ["relay_id"],
                     "properties": {"relay_id": {"type": "string", "pattern": NAME_PATTERN},
                                    "url": {"type": ["string", "null"], "maxLength": 512},
                                    "base_model": {"oneOf": [_ref("BaseModel"), {"type": "null"}]}}}}}},
                 "responses": {"200": _json({"type": "object", "required": ["relay_id", "experts"]},
                                            "Registered; ``token`` is the relay's token when auth is on; ``limits`` "
                                            "the root's --server-lr and --norm-* settings, which the relay "
                                            "applies to its workers' updates before acknowledging them."),
                               "400": BAD_REQUEST,
                               "403": _error("The relay id is active, or the token may not register relays."),
                               "409": _error("The relay's base model differs from an expert's."),
                               "413": _error("JSON body over 1 MiB.")}}},
    "/experts/{name}/dp-cohorts": {"post": {
        "operationId": "bookDPCohort",
        "summary": "A relay (relay token) books one of its DP cohorts' steps before unmasking it; once per cohort.",
        "parameters": [EXPERT_NAME],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("DPCohortSum")}}},
        "responses": {"200": _json({"type": "object", "required": ["cohort", "booked"]}, "Booked (or already)."),
                      "400": BAD_REQUEST, "403": _error("Not a relay's token."), "404": _error("No such expert."),
                      "409": _error("privacy_budget_spent; dp_cohort_mismatch (sigma or C not this root's); "
                                    "dp_relay_batch (this root does not run DP with secure aggregation)."),
                      "413": _error("JSON body over 1 MiB.")}}},
    "/relays/{relay_id}/report": {"post": {
        "operationId": "relayReport", "summary": "A relay reports its workers and byte counters.",
        "parameters": [_path_param("relay_id", NAME_PATTERN, "site-a", "The relay's id.")],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"workers": {"type": "array", "items": {"type": "object"}},
                                             "stats": {"type": "object"}}}}}},
        "responses": {"200": _json({"type": "object"}, "Noted."), "400": BAD_REQUEST,
                      "403": _error("Not this relay's token."), "413": _error("JSON body over 1 MiB.")}}},
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
        "responses": {"200": _json({"type": "object", "required": ["relay_id", "generation", "planned"]},
                                   "The worker's assignment: a relay id, or null for the root."),
                      "400": BAD_REQUEST, "403": _error("Not this worker's token."),
                      "404": _error("No such worker registered here.")}}},
    "/placement": {"get": {
        "operationId": "placement", "summary": "The root's plan: its generation and groups, each with its relay.",
        "responses": {"200": _json({"type": "object", "required": ["generation", "groups"]}, "The plan.")}}},
}

_root: dict[str, Any] = {
    "/": {"get": {"operationId": "dashboard", "summary": "The dashboard page.",
                  "responses": {"200": {"description": "HTML page.",
                                        "content": {"text/html": {"schema": {"type": "string"}}}}}}},
    "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics.",
                         "responses": {"200": {"description": "Prometheus text format.",
                                               "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "FedMoE coordinator", "version": "1",
             "description": "Federated fine-tuning of LoRA experts. Every bad request is a 4xx with an Error body."},
    "paths": {**{API_PREFIX + path: item for path, item in {**_api, **_relays}.items()}, **_root},
    "components": {"schemas": SCHEMAS,
                   "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                  "description": "admin, join or worker token (README: Security)"}}},
    "security": [{"bearer": []}],
}
