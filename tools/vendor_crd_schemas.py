#!/usr/bin/env python3
"""Vendor the OpenAPI schemas of the KServe, KEDA and KubeRay custom resources that deploy/ uses.

    python tools/vendor_crd_schemas.py --kserve PATH/TO/kserve --kserve-ref v0.20.0 \
                                       --keda PATH/TO/keda --keda-ref v2.20.2 \
                                       --kuberay PATH/TO/kuberay --kuberay-ref v1.7.0

Each PATH is a git clone of github.com/kserve/kserve, github.com/kedacore/keda or
github.com/ray-project/kuberay (give any of them: only those are rewritten); the CRD files
are read at the given tag with `git show`, so the result does not depend on the work tree. Only
the schema of the served storage version is kept, and from the InferenceService only what a
predictor needs (the `canary`, `explainer`, `transformer`, `predictor.workerSpec` and `status`
schemas are replaced by a schema that rejects any value, so a manifest that starts using one
fails the test until it is vendored). Output: tests/schemas/<plural>.<group>.json, each with a
`$comment` naming the repository, path, tag, commit and the sha256 of the source file.

tests/test_deploy.py validates the custom resources in deploy/ against these files offline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "schemas"

SOURCES = {
    "kserve": ("https://github.com/kserve/kserve", [
        ("config/crd/full/serving.kserve.io_inferenceservices.yaml",
         {"spec": ["canary", "explainer", "transformer"], "spec.predictor": ["workerSpec"], "": ["status"]}),
        ("config/crd/full/serving.kserve.io_servingruntimes.yaml", {"spec": ["workerSpec"], "": ["status"]}),
    ]),
    "keda": ("https://github.com/kedacore/keda", [
        ("config/crd/bases/keda.sh_scaledobjects.yaml", {"": ["status"]}),
    ]),
    "kuberay": ("https://github.com/ray-project/kuberay", [
        ("ray-operator/config/crd/bases/ray.io_rayservices.yaml", {"": ["status"]}),
    ]),
}

REJECT = {"not": {}, "$comment": "not vendored (tools/vendor_crd_schemas.py): vendor it before using it"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _prune(schema: dict, drops: dict[str, list[str]]) -> None:
    for where, names in drops.items():
        node = schema
        for key in [k for k in where.split(".") if k]:
            node = node["properties"][key]
        for name in names:
            if name in node.get("properties", {}):
                node["properties"][name] = REJECT


def vendor(name: str, repo: Path, ref: str) -> list[Path]:
    """Write the pruned schemas of one project's CRDs at `ref`; return the files written."""
    url, files = SOURCES[name]
    commit = _git(repo, "rev-parse", f"{ref}^{{commit}}").strip()
    written = []
    for path, drops in files:
        text = _git(repo, "show", f"{commit}:{path}")
        crd = yaml.safe_load(text)
        version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
        schema = version["schema"]["openAPIV3Schema"]
        _prune(schema, drops)
        group, kind, plural = crd["spec"]["group"], crd["spec"]["names"]["kind"], crd["spec"]["names"]["plural"]
        schema["$comment"] = (
            f"{kind} {group}/{version['name']}: openAPIV3Schema of {url}/blob/{ref}/{path} "
            f"(tag {ref}, commit {commit}, sha256 {hashlib.sha256(text.encode()).hexdigest()}); "
            f"pruned: {json.dumps(drops)}. Regenerate with tools/vendor_crd_schemas.py.")
        schema["x-outrider-source"] = {"repository": url, "path": path, "tag": ref, "commit": commit,
                                       "apiVersion": f"{group}/{version['name']}", "kind": kind}
        out = OUT / f"{plural}.{group}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(schema, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
        written.append(out)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kserve", type=Path, help="git clone of kserve/kserve")
    parser.add_argument("--kserve-ref", default="v0.20.0")
    parser.add_argument("--keda", type=Path, help="git clone of kedacore/keda")
    parser.add_argument("--keda-ref", default="v2.20.2")
    parser.add_argument("--kuberay", type=Path, help="git clone of ray-project/kuberay")
    parser.add_argument("--kuberay-ref", default="v1.7.0")
    args = parser.parse_args()
    given = [(name, getattr(args, name), getattr(args, f"{name}_ref")) for name in SOURCES if getattr(args, name)]
    if not given:
        parser.error("give at least one of --kserve, --keda, --kuberay")
    for name, repo, ref in given:
        for path in vendor(name, repo, ref):
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
