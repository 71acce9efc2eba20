"""Validates every KEDA ScaledObject of a rendered overlay against KEDA's own CRD schema
(check/keda/keda.sh_scaledobjects.yaml, its source in check/keda/SOURCE): the CRD's
openAPIV3Schema as JSON Schema, and every field the schema does not name refused, as
`kubectl apply --validate=strict` refuses it. Prints one line per ScaledObject; exits 1
on any problem, or when the overlay has none."""
import os
import sys

import jsonschema
import yaml

here = os.path.dirname(os.path.abspath(__file__))
crd = yaml.safe_load(open(os.path.join(here, "keda", "keda.sh_scaledobjects.yaml")))
versions = {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]}


def unknown(schema, value, path):
    """Fields of `value` that `schema` does not name (where it names its fields)."""
    out = []
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            if props is not None and k in props:
                out += unknown(props[k], v, f"{path}.{k}")
            elif isinstance(extra, dict):
                out += unknown(extra, v, f"{path}.{k}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{k}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += unknown(schema["items"], v, f"{path}[{i}]")
    return out


bad = seen = 0
for file in sys.argv[1:]:
    for doc in yaml.safe_load_all(open(file)):
        if not doc or doc.get("kind") != "ScaledObject":
            continue
        seen += 1
        name = f"scaledobject/{doc['metadata']['name']}"
        group, _, version = doc["apiVersion"].partition("/")
        schema = versions.get(version)
        if group != crd["spec"]["group"] or schema is None:
            print(f"ERROR {file} {name}: no CRD version {doc['apiVersion']}")
            bad += 1
            continue
        problems = [
            f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
        ]
        problems += [f"{p}: unknown field" for p in unknown(schema, doc, "")]
        if problems:
            bad += 1
            for p in problems:
                print(f"ERROR {file} {name}: {p}")
        else:
            print(f"INFO {file} passed for {name} against KEDA's CRD schema ({doc['apiVersion']})")
if seen == 0:
    print("no ScaledObject found")
    sys.exit(1)
sys.exit(1 if bad else 0)
