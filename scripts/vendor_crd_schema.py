"""Vendor one version of a published CRD's schema into deploy/schemas/, small and reproducible.

    git -C gateway-api show v1.6.1:config/crd/standard/gateway.networking.k8s.io_httproutes.yaml > crd.yaml
    python scripts/vendor_crd_schema.py crd.yaml --version v1 \\
        --source https://github.com/kubernetes-sigs/gateway-api/blob/v1.6.1/config/crd/standard/gateway.networking.k8s.io_httproutes.yaml \\
        --commit <the tag's commit> > deploy/schemas/httproute-gateway.networking.k8s.io-v1.json

Keeps the named version's `openAPIV3Schema` exactly as published except its `description`
fields (prose, most of the bytes); records the source, the commit and the sha256 of the file
read, so anyone can check the vendored schema against upstream by running this again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml


def without_descriptions(node: Any) -> Any:
    """The schema with every `description` that documents a field dropped (a property that is
    itself named "description" is kept: it is a field, not prose)."""
    if isinstance(node, list):
        return [without_descriptions(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description" and isinstance(value, str):
            continue
        if key == "properties":
            out[key] = {name: without_descriptions(v) for name, v in value.items()}
        else:
            out[key] = without_descriptions(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("crd", type=Path)
    ap.add_argument("--version", required=True, help="the CRD version to keep, e.g. v1")
    ap.add_argument("--source", required=True, help="where the CRD file is published (URL at the tag)")
    ap.add_argument("--commit", required=True, help="the commit the tag names")
    args = ap.parse_args(argv)
    raw = args.crd.read_bytes()
    crd = yaml.safe_load(raw)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == args.version]
    vendored = {
        "source": args.source,
        "commit": args.commit,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "group": crd["spec"]["group"],
        "kind": crd["spec"]["names"]["kind"],
        "version": args.version,
        "transformation": "the version's openAPIV3Schema with its description fields dropped "
        "(scripts/vendor_crd_schema.py)",
        "openAPIV3Schema": without_descriptions(version["schema"]["openAPIV3Schema"]),
    }
    json.dump(vendored, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
