"""OpenAPI 3 description of the coordinator's HTTP API, served at GET /api/v1/openapi.json.

Written by hand as a plain dict so it reads like documentation and stays free of a framework.
Tensor bodies are raw bytes (safetensors or a compression payload) with their JSON metadata in
one header; every error is the JSON object ``Error``. tests/e2e/test_openapi_fuzz.py fuzzes a live
server from this description with schemathesis, and tests/coordinator/test_openapi.py checks
that it names every route the app has.
"""
from __future__ import annotations

from typing import Any

from coordinator.api.openapi_parts import (BAD_REQUEST, EXPERT_NAME, NAME_PATTERN, NOT_FOUND, STORAGE_FULL, TENSOR_BODY,
                                           UPDATE_ID, UPDATE_ID_PATTERN, VERSION_HEADERS, VERSION_QUERY, WORKER_ID,
                                           bytes_response, error_response, header_param, json_param, json_response,
                                           query_param, schema_ref)
from coordinator.api.openapi_wan import RELAY_PATHS, UPLOAD_PATHS
from protocol.profiles import DEFAULT_DIM, DEFAULT_NGRAMS
from protocol.schemas import (API_PREFIX, EXPERT_HEADER, MAX_BATCH_MEMBERS, MAX_COUNT, UPDATE_HEADER, WORKER_HEADER)


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
        "properties": {"lora": schema_ref("Lora"), "base_model": schema_ref("BaseModel"),
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
                       "dp_cohort": schema_ref("DPCohortSum")},
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
                       "lora": schema_ref("Lora"), "base_model": schema_ref("BaseModel"),
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
        "responses": {"200": json_response({"type": "object", "required": ["status", "experts", "store"],
                                    "properties": {"status": {"type": "string"}, "experts": {"type": "integer"},
                                                   "store": {"type": "string", "enum": ["ok", "slow", "unavailable"],
                                                             "description": "ok: experts was read just now; "
                                                             "slow or unavailable: the last count read, the "
                                                             "store did not answer within 0.5 s or failed."}}},
                                   "The coordinator is up.")}}},
    "/openapi.json": {"get": {
        "operationId": "openapi", "summary": "This description.",
        "responses": {"200": json_response({"type": "object"}, "OpenAPI 3 document.")}}},
    "/workers": {
        "get": {"operationId": "listWorkers", "summary": "Registered workers with their liveness.",
                "responses": {"200": json_response({"type": "object", "required": ["workers"],
                                            "properties": {"workers": {"type": "array", "items": schema_ref("Worker")}}},
                                           "All workers.")}},
        "post": {"operationId": "registerWorker",
                 "summary": "Register a worker; with its own (even expired) token, renew it (docs/identity.md).",
                 "requestBody": {"required": True, "content": {"application/json": {"schema": {
                     "type": "object", "required": ["worker_id", "specialty", "base_model"],
                     "properties": {"worker_id": {"type": "string", "pattern": NAME_PATTERN},
                                    "specialty": {"type": "string", "pattern": NAME_PATTERN},
                                    "base_model": schema_ref("BaseModel"),
                                    "sync_interval": {"type": ["number", "null"], "exclusiveMinimum": 0}}}}}},
                 "responses": {"200": json_response({"type": "object", "required": ["worker_id", "specialty", "expert"]},
                                            "Registered; ``expert`` is the expert's info or null."),
                               "400": BAD_REQUEST,
                               "403": error_response("The worker id is active (needs its own token or admin), revoked, "
                                             "or the token is another worker's."),
                               "409": error_response("The worker's base model differs from the expert's."),
                               "413": error_response("JSON body over 1 MiB.")}},
    },
    "/workers/{worker_id}": {"delete": {
        "operationId": "revokeWorker", "summary": "Admin: revoke a worker's tokens; its id cannot register again.",
        "parameters": [WORKER_ID],
        "responses": {"200": json_response({"type": "object", "required": ["worker_id", "revoked"]}, "Revoked."),
                      "400": BAD_REQUEST, "401": error_response("Missing or invalid token."),
                      "403": error_response("Not an admin token.")}}},
    "/workers/{worker_id}/heartbeat": {"post": {
        "operationId": "heartbeat", "summary": "A worker says it is alive.", "parameters": [WORKER_ID],
        "responses": {"200": json_response({"type": "object"}, "Noted."), "404": NOT_FOUND}}},
    "/experts": {"get": {
        "operationId": "listExperts", "summary": "Every expert with its version and counters.",
        "responses": {"200": json_response({"type": "object", "required": ["experts"],
                                    "properties": {"experts": {"type": "array", "items": schema_ref("Expert")}}},
                                   "All experts.")}}},
    "/experts/{name}": {
        "get": {"operationId": "expertInfo", "summary": "One expert and its stored versions.",
                "parameters": [EXPERT_NAME],
                "responses": {"200": json_response(schema_ref("Expert"), "The expert."), "404": NOT_FOUND}},
        "put": {"operationId": "createExpert", "summary": "Create an expert from its first LoRA adapter.",
                "parameters": [EXPERT_NAME,
                               json_param(EXPERT_HEADER, "header", schema_ref("ExpertSpec"), "The expert's setup.")],
                "requestBody": TENSOR_BODY | {"description": "The initial adapter as a safetensors file."},
                "responses": {"200": json_response(schema_ref("Expert"), "It existed with the same setup."),
                              "201": json_response(schema_ref("Expert"), "Created."), "400": BAD_REQUEST,
                              "409": error_response("It exists with a different setup."),
                              "413": error_response("Body over --max-body-mb."),
                              "422": error_response("The tensors are not a LoRA adapter of that spec."),
                              "507": STORAGE_FULL}},
    },
    "/experts/{name}/weights": {"get": {
        "operationId": "expertWeights",
        "summary": "Full weights (safetensors), or with since= the compressed difference from that version.",
        "parameters": [EXPERT_NAME,
                       query_param("version", VERSION_QUERY, "Version (default: current)."),
                       query_param("since", VERSION_QUERY, "Send that version minus this one."),
                       query_param("codec", {"type": "string"}, "Codec of the difference (default fp16)."),
                       json_param("codec_config", "query", {"type": "object"}, "Codec options as a JSON object."),
                       header_param("If-None-Match", "ETag held by the caller."),
                       header_param(WORKER_HEADER, "Worker id, to count bytes per worker; with a worker token, "
                                              "it must be the token's (the token's worker is counted anyway).")],
        "responses": {"200": bytes_response("Weights or difference.", VERSION_HEADERS),
                      "304": {"description": "Unchanged since the ETag or version held."},
                      "400": BAD_REQUEST, "403": error_response("X-FedMoE-Worker names another worker than the token's."),
                      "404": error_response("No such expert or version; or no difference can be served (version pruned, "
                                    "the expert kept changing, or it does not fit the codec, e.g. fp16's range; "
                                    "details.reason): pull full weights."),
                      "409": error_response("The expert kept changing while its full weights were opened: pull again.")}}},
    "/experts/{name}/updates": {"post": {
        "operationId": "pushUpdate", "summary": "Push a compressed delta; 202 once durable, 200 for a retry.",
        "parameters": [EXPERT_NAME, json_param(UPDATE_HEADER, "header", schema_ref("UpdateMeta"), "The update's metadata.")],
        "requestBody": TENSOR_BODY | {"description": "Delta as safetensors, or a compression payload."},
        "responses": {"202": json_response(schema_ref("UpdateStatus"), "Recorded on disk (and maybe applied)."),
                      "200": json_response(schema_ref("UpdateStatus"), "The same update_id and bytes were seen before."),
                      "400": BAD_REQUEST, "404": NOT_FOUND,
                      "409": error_response("update_id reused with other bytes or expert, or base_version ahead."),
                      "413": error_response("Body over --max-body-mb."),
                      "422": error_response("Tensors do not fit the expert (names, shapes, dtype, NaN/Inf), the "
                                    "update's norm is over the limit (--norm-check reject), or applying it would "
                                    "overflow float32 (details.reason result_not_finite); nothing was recorded."),
                      "507": STORAGE_FULL}}},
    "/events": {"get": {
        "operationId": "listEvents", "summary": "The audit log, newest first: creations, registrations, updates "
                                                "accepted/duplicate/rejected/clipped, versions applied.",
        "parameters": [query_param("limit", {"type": "integer", "minimum": 1, "maximum": 500}, "Events to return (50)."),
                       query_param("after", {"type": "integer", "minimum": 0}, "Only events with a larger id."),
                       query_param("expert", {"type": "string"}, "Only this expert's events."),
                       query_param("kind", {"type": "string"}, "Only events of this kind.")],
        "responses": {"200": json_response({"type": "object", "required": ["events"], "properties": {
            "events": {"type": "array", "items": {"type": "object", "required": ["id", "time", "kind", "message"]}}}},
            "Events."), "400": BAD_REQUEST}}},
    "/updates/{update_id}": {"get": {
        "operationId": "updateStatus", "summary": "Whether an update is pending or applied.",
        "parameters": [UPDATE_ID],
        "responses": {"200": json_response(schema_ref("UpdateStatus"), "Known update."), "404": NOT_FOUND}}},
    "/experts/{name}/profiles/{worker_id}": {"put": {
        "operationId": "putProfile", "summary": "Store a worker's data profile for routing.",
        "parameters": [EXPERT_NAME, WORKER_ID],
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema_ref("Profile")}}},
        "responses": {"200": json_response({"type": "object"}, "Stored."), "400": BAD_REQUEST, "404": NOT_FOUND,
                      "413": error_response("JSON body over 1 MiB.")}}},
    "/profiles": {"get": {
        "operationId": "listProfiles", "summary": "Every expert's combined routing profile and the threshold.",
        "responses": {"200": json_response({"type": "object", "required": ["threshold", "profiles"], "properties": {
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
        "responses": {"200": json_response({"type": "object", "required": ["target"]}, "The choice and its scores."),
                      "400": BAD_REQUEST, "404": error_response("No expert has a routing profile yet."),
                      "413": error_response("JSON body over 64 KiB (only the first 8192 characters of a prompt are read).")}}},
    "/gateway": {"get": {
        "operationId": "gatewayInfo", "summary": "The newest gateway built from the experts (rebuilt in the background).",
        "parameters": [query_param("fresh", {"type": "string", "enum": ["0", "1"]},
                              "1: build from the experts as they are now (at once) and wait for it.")],
        "responses": {"200": json_response(schema_ref("Gateway"), "Gateway info."), "404": error_response("No expert yet."),
                      "409": error_response("The experts cannot be merged."),
                      "503": error_response("The first gateway is still being built; retry after Retry-After.")}}},
    "/gateway/weights": {"get": {
        "operationId": "gatewayWeights", "summary": "The gateway adapter as safetensors or npz.",
        "parameters": [query_param("format", {"type": "string", "enum": ["safetensors", "npz"]}, "File format."),
                       query_param("fresh", {"type": "string", "enum": ["0", "1"]},
                              "1: build from the experts as they are now (at once) and wait for it."),
                       header_param("If-None-Match", "ETag held by the caller.")],
        "responses": {"200": bytes_response("The gateway adapter.", VERSION_HEADERS),
                      "304": {"description": "Unchanged since the ETag held."},
                      "400": BAD_REQUEST, "404": error_response("No expert yet."),
                      "409": error_response("The experts cannot be merged."),
                      "503": error_response("The first gateway is still being built; retry after Retry-After.")}}},
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
    "paths": {**{API_PREFIX + path: item for path, item in {**_api, **UPLOAD_PATHS, **RELAY_PATHS}.items()}, **_root},
    "components": {"schemas": SCHEMAS,
                   "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                  "description": "admin, join or worker token (README: Security)"}}},
    "security": [{"bearer": []}],
}
