"""Check that every synthetic checkpoint preset loads in Hugging Face transformers.

NOT run in CI (needs torch + transformers). Run with the oracle venv from the repo root:

    /work/oracle-venv/bin/python scripts/check_presets_hf.py [--full PRESET ...]

For every preset, the project venv writes config + tokenizer files (no weights), and this script
checks with transformers: AutoConfig reads it as the right class with the same shapes,
AutoTokenizer has exactly vocab_size ids, its BOS/EOS are the config's, the chat template
renders. For the `--full` presets (default: tiny) it writes the whole checkpoint, loads it with
AutoModelForCausalLM (no missing/unexpected weights) and compares fp32 logits with the
reference engine's (max |diff| / max |ref|).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PY = str(ROOT / ".venv" / "bin" / "python")
PRESETS = ["tiny", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-1.7b",
           "qwen2.5-1.5b", "mistral-7b"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42"},
            {"role": "user", "content": "Thanks"}]


def project(code: str) -> str:
    """Run Python code in the project venv (which has ml_dtypes etc.); returns its stdout."""
    return subprocess.run([PROJECT_PY, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def check_metadata(preset: str, out: Path) -> None:
    project(f"from replicas.checkpoint import write_metadata; write_metadata({preset!r}, {str(out)!r})")
    raw = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert type(cfg).__name__.replace("Config", "ForCausalLM") == raw["architectures"][0], type(cfg)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(cfg, key) == raw[key], (key, getattr(cfg, key), raw[key])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == raw["vocab_size"], (len(tok), raw["vocab_size"])
    assert tok.eos_token_id in gen["eos_token_id"], (tok.eos_token, gen)
    if tok.bos_token is not None:
        assert tok.bos_token_id == gen["bos_token_id"]
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    print(f"{preset:14s} config {type(cfg).__name__}, tokenizer {len(tok)} ids, chat prompt {len(ids)} tokens: ok")


def check_full(preset: str, out: Path) -> None:
    project(f"from replicas.checkpoint import make_checkpoint; make_checkpoint({preset!r}, {str(out)!r})")
    ids = list(range(3, 40, 3))
    logits_file = out.parent / f"{preset}-ref.npy"
    project("import numpy as np; from replicas.reference import ReferenceEngine; "
            f"np.save({str(logits_file)!r}, ReferenceEngine.from_pretrained({str(out)!r}).forward_logits({ids}))")
    ref = np.load(logits_file)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, problems
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].numpy()
    rel = float(np.abs(hf - ref).max() / np.abs(ref).max())
    top1 = float(torch.softmax(torch.tensor(hf), -1).max(-1).values.mean())
    print(f"{preset:14s} weights load in transformers; logits vs reference rel {rel:.2e}; mean top-1 prob {top1:.2f}")
    assert rel < 1e-4, rel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", nargs="*", default=["tiny"], help="presets to write in full and run")
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in PRESETS:
            check_metadata(preset, Path(tmp) / f"{preset}-meta")
        for preset in args.full:
            check_full(preset, Path(tmp) / preset)
    return 0


if __name__ == "__main__":
    sys.exit(main())
