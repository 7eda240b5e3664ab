"""A GGUF's first-start conversion, run in a child process.

Reading a GGUF with gguf-py and repacking its tensors allocates a few hundred MB of short-lived
numpy and torch buffers. In the serving process, glibc keeps about 90 MB of that heap after the
conversion, whatever `malloc_trim` does (fragmented by what the load allocates next), so a
server's first start held 459 MB where a warm start of the same file holds 371 MB, until it was
restarted. In a child, all of it is gone when the child exits, and a conversion that runs out of
memory takes the child down, not the server.

    python -m outrider_llm.conversion native|float GGUF DIRECTORY

writes the artifact's files into DIRECTORY and prints one JSON line: {"figures": {...}} or
{"error": CLASS, "message": TEXT}. The parent raises a `GGUFError` again as a `GGUFError` (the
file cannot be served: deterministic), anything else as a RuntimeError naming the class.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from outrider.artifacts import Artifact, ArtifactCache

from .artifact import BLOCKS_FORMAT, CACHE_FORMAT, NATIVE_KIND, WEIGHTS_KIND, GGUFError

KINDS = ("native", "float", "tokenizer")  # tokenizer: tokenizer.json alone (gguf_tiles.py packs the rest)


class ChildConversion:
    """`convert(kind, gguf, directory)` running in a child Python from construction on, so the caller
    can do other work meanwhile (the tokenizer is built on the second core while the tiles are packed);
    `result()` waits for its figures or raises its error here, `cancel()` stops it."""

    def __init__(self, kind: str, gguf: Path, directory: Path) -> None:
        import outrider

        self.kind, self.gguf = kind, gguf
        # The child imports both packages from where this process found them (a test's sys.path, an
        # editable install or site-packages alike).
        roots = [str(Path(__file__).resolve().parent.parent), str(Path(outrider.__file__).resolve().parent.parent)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(roots + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._proc = subprocess.Popen([sys.executable, "-m", "outrider_llm.conversion", kind, str(gguf), str(directory)],
                                      stdout=subprocess.PIPE, stderr=None, env=env, text=True)

    def cancel(self) -> None:
        """Stop it (nothing to do once `result()` has returned)."""
        if self._proc.poll() is None:
            self._proc.kill()
        if not self._proc.stdout.closed:
            self._proc.communicate()

    def result(self) -> dict:

        stdout, _ = self._proc.communicate()
        answer = None
        for line in reversed(stdout.splitlines()):
            try:
                answer = json.loads(line)
                break
            except ValueError:
                continue
        if not isinstance(answer, dict):
            raise RuntimeError(f"converting {self.gguf} ({self.kind}): the conversion process exited with code "
                               f"{self._proc.returncode} and no answer (killed for memory?)")
        if "error" in answer:
            if answer["error"] == "GGUFError":
                raise GGUFError(answer["message"])
            raise RuntimeError(f"converting {self.gguf} ({self.kind}) failed: {answer['error']}: {answer['message']}")
        return answer["figures"]


def convert_in_child(kind: str, gguf: Path, directory: Path) -> dict:
    """Run `convert(kind, gguf, directory)` in a child Python; its figures, or its error raised here."""
    return ChildConversion(kind, gguf, directory).result()


def convert(kind: str, gguf: Path, directory: Path) -> dict:
    """Write the "llama-weights" artifact of `gguf` into `directory`: the file's own blocks
    (`native`) or fp32 weights (`float`); the figures its provenance records."""
    from .artifact import WEIGHTS_FILE
    from .gguf_reading import gguf_tokenizer as _gguf_tokenizer
    from .gguf_to_artifact import read_gguf, write_artifact

    if kind not in KINDS:
        raise ValueError(f"conversion kind {kind!r}: expected one of {KINDS}")
    if kind == "tokenizer":
        from .artifact import TOKENIZER_FILE
        from .gguf_reading import gguf_tokenizer

        gguf_tokenizer(gguf).save(str(directory / TOKENIZER_FILE))
        return {}
    config, state_dict, meta = read_gguf(gguf, native=kind == "native")
    write_artifact(directory, config, state_dict, meta, _gguf_tokenizer(gguf))
    figures = {"tensors": len(state_dict), "bytes": (directory / WEIGHTS_FILE).stat().st_size}
    if kind == "native":
        figures["block_types"] = meta["block_types"]
        figures["converted"] = {k: len(v) for k, v in meta["converted"].items()}
    return figures


def load_weights_artifact(gguf_path: "str | Path", cache: Optional[ArtifactCache] = None,
                          in_child: bool = False) -> Artifact:
    """The GGUF converted to a "llama-weights" artifact (see the module docstring), built once;
    with `in_child`, built by a child process (conversion.py: what a server does)."""
    return _converted("float", gguf_path, cache, in_child)


def load_native_artifact(gguf_path: "str | Path", cache: Optional[ArtifactCache] = None,
                         in_child: bool = False) -> Artifact:
    """The GGUF as a "llama-weights" artifact holding its quantized matrices in their own block
    types (`read_gguf(native=True)`), built once: a warm start reads it without conversion. With
    `in_child`, built by a child process (conversion.py: what a server does)."""
    return _converted("native", gguf_path, cache, in_child)


def _converted(kind: str, gguf_path: "str | Path", cache: Optional[ArtifactCache], in_child: bool) -> Artifact:
    """The cached conversion of `gguf_path` of `kind` (conversion.KINDS), built once."""
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    cache = cache or ArtifactCache()

    def build(directory: Path, progress: Any) -> dict:
        return (convert_in_child if in_child else convert)(kind, path, directory)

    native = kind == "native"
    return cache.get_or_build(
        NATIVE_KIND if native else WEIGHTS_KIND, build,
        label=f"{path.name} -> {'its own blocks' if native else 'fp32 weights'}", sources=[path],
        versions=["torch", "gguf", "transformers"],
        options={"format": CACHE_FORMAT, **({"blocks": BLOCKS_FORMAT} if native else {})},
    )


def main(argv: list[str]) -> int:
    logging.basicConfig(level=getattr(logging, os.environ.get("OUTRIDER_LOG_LEVEL", "INFO").upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    kind, gguf, directory = argv[0], Path(argv[1]), Path(argv[2])
    try:
        answer: dict = {"figures": convert(kind, gguf, directory)}
    except Exception as exc:  # reported to the parent, which decides what it means
        answer = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(answer, default=str), flush=True)
    return 0 if "figures" in answer else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
