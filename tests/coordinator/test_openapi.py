"""The served OpenAPI description covers every route the app has, with the methods it has."""
import re

from coordinator.api.openapi import OPENAPI


def test_every_route_and_method_is_described(client):
    served = client.get("/api/v1/openapi.json")
    assert served.status_code == 200 and served.get_json() == OPENAPI
    routes: dict[str, set[str]] = {}
    for rule in client.application.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        routes.setdefault(path, set()).update(m.lower() for m in rule.methods - {"HEAD", "OPTIONS"})
    described = {path: set(item) for path, item in OPENAPI["paths"].items()}
    assert described == routes


def test_every_operation_documents_its_parameters_and_errors():
    for path, item in OPENAPI["paths"].items():
        for method, op in item.items():
            names = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert names == set(re.findall(r"{(\w+)}", path)), (method, path)
            for status, response in op["responses"].items():
                if status.startswith("4"):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)
