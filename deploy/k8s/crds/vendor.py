"""Vendor the CRDs that deploy/k8s/inference-gateway/ is validated against (tests/deploy/test_deploy_gateway.py), from
their releases: each CRD's storage version only, without descriptions (every validation stays: types, enums,
patterns, limits, defaults, CEL rules). A maintainer's tool, run with network access when the pins move:

    python deploy/k8s/crds/vendor.py            # the pinned release URLs below
    python deploy/k8s/crds/vendor.py FILE...    # or local copies of the same files
"""
import os
import sys
import urllib.request

import yaml

GATEWAY_API = "https://raw.githubusercontent.com/kubernetes-sigs/gateway-api/v1.6.1/config/crd/standard"
INFERENCE = "https://raw.githubusercontent.com/kubernetes-sigs/gateway-api-inference-extension/v1.6.0/config/crd/bases"
SOURCES = [f"{GATEWAY_API}/gateway.networking.k8s.io_gateways.yaml",
           f"{GATEWAY_API}/gateway.networking.k8s.io_httproutes.yaml",
           f"{INFERENCE}/inference.networking.k8s.io_inferencepools.yaml"]


def read(source: str) -> str:
    if source.startswith("https://"):
        with urllib.request.urlopen(source, timeout=30) as r:
            return r.read().decode()
    with open(source) as f:
        return f.read()


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def main(sources: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for source in sources:
        crd = yaml.safe_load(read(source))
        crd["spec"]["versions"] = [v for v in crd["spec"]["versions"] if v.get("storage")]
        name = crd["metadata"]["name"]
        versions = {k: v for k, v in crd["metadata"].get("annotations", {}).items() if k.endswith("bundle-version")}
        header = (f"# {name}: {', '.join(versions.values())}, vendored by vendor.py from {os.path.basename(source)}\n"
                  "# (storage version only, descriptions removed). Apache License 2.0, The Kubernetes Authors.\n")
        with open(os.path.join(here, f"{name}.yaml"), "w") as f:
            f.write(header + yaml.safe_dump(without_descriptions(crd), sort_keys=False, width=120))
        print(f"wrote {name}.yaml")


if __name__ == "__main__":
    main(sys.argv[1:] or SOURCES)
