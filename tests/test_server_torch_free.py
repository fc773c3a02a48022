"""The front process imports neither torch nor the model stack: its modules import, and
the tokenizer loads the way the front loads it, in a process where `import torch` raises;
that tokenizer is the one the engine uses (same ids, text and chat template)."""

from __future__ import annotations

import json
import subprocess
import sys

from server_utils import REPO

SAMPLES = ["Hello, world!", "  spaces\tand\nnewlines ", "émoji 😀 ünïcode", "<|user|>x<|end|>"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

SCRIPT = """
import importlib.abc, json, sys

class BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError(f"the front imported {name}")
        return None

sys.meta_path.insert(0, BlockTorch())
import radixrt.server.front, radixrt.server.launch, radixrt.server.http_api
import radixrt.server.protocol, radixrt.server.validate, radixrt.server.openai_routes
import radixrt.frontend.backends.http  # the DSL over HTTP reads the tokenizer the same way
from radixrt.hf_dir import check_model_dir, load_tokenizer

model_dir, samples, messages = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
check_model_dir(model_dir)
tok = load_tokenizer(model_dir)
heavy = ("torch", "radixrt.model", "radixrt.engine", "radixrt.attention", "radixrt.kv",
         "radixrt.cache", "radixrt.scheduler", "radixrt.kernels", "triton", "flashinfer")
loaded = sorted(m for m in sys.modules if sys.modules[m] is not None and m.startswith(heavy))
ids = [tok.encode(s) for s in samples]
print(json.dumps({
    "loaded": loaded,
    "ids": ids,
    "text": [tok.decode(i, skip_special_tokens=True) for i in ids],
    "chat": tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
    "eos": tok.eos_token_id,
}))
"""


def test_front_imports_no_torch_and_loads_the_same_tokenizer(tiny_model_dir):
    args = [tiny_model_dir, json.dumps(SAMPLES), json.dumps(MESSAGES)]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == []
    assert "PyTorch was not found" not in out.stderr

    from radixrt.hf_dir import load_tokenizer  # here with torch imported

    ref = load_tokenizer(tiny_model_dir)
    assert got["ids"] == [ref.encode(s) for s in SAMPLES]
    assert got["text"] == [ref.decode(i, skip_special_tokens=True) for i in got["ids"]]
    assert got["chat"] == ref.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert got["eos"] == ref.eos_token_id
