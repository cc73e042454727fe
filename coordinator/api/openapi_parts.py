"""The pieces the OpenAPI description is built from: name patterns, common parameters and response shapes."""
from __future__ import annotations

from typing import Any

from protocol.schemas import VERSION_HEADER

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
UPDATE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
EXAMPLE_EXPERT = "python_expert"  # tests seed an expert of this name so examples reach real data


def schema_ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def error_response(description: str) -> dict[str, Any]:
    return json_response(schema_ref("Error"), description)


def bytes_response(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description,
                                "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                    "format": "binary"}}}}
    if headers:
        response["headers"] = headers
    return response


def path_param(name: str, pattern: str, example: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string", "pattern": pattern}, "example": example}


def query_param(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def header_param(name: str, description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": required, "description": description,
            "schema": {"type": "string"}}


def json_param(name: str, where: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A parameter holding a JSON document (the metadata headers, codec_config)."""
    return {"name": name, "in": where, "required": where == "header", "description": description,
            "content": {"application/json": {"schema": schema}}}


EXPERT_NAME = path_param("name", NAME_PATTERN, EXAMPLE_EXPERT, "Expert name (the workers' --specialty).")
WORKER_ID = path_param("worker_id", NAME_PATTERN, "worker-1", "Worker id.")
UPDATE_ID = path_param("update_id", UPDATE_ID_PATTERN, "worker-1:0001", "The update_id a worker chose.")
VERSION_HEADERS = {VERSION_HEADER: {"description": "Expert version of the body.", "schema": {"type": "string"}}}
VERSION_QUERY = {"type": "string", "pattern": "^[0-9]{1,18}$"}  # ASCII digits within SQLite's 64-bit integers
TENSOR_BODY = {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}
BAD_REQUEST = error_response("Malformed request: a field, header, query parameter or body is wrong.")
NOT_FOUND = error_response("No such expert, version, worker or update.")
STORAGE_FULL = error_response("The coordinator's disk is full: nothing was recorded; retry once space is freed.")
