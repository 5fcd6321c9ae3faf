"""`monoserve make-checkpoint` and local `monoserve generate`, run through the real CLI entry."""

import json

import pytest
from tokenizers import Tokenizer

from cluster.cli import main
from replicas.cli_cmds import stream_text
from replicas.engine import SamplingParams
from replicas.model import ModelConfig


def test_make_checkpoint_writes_a_loadable_dir(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--seed", "3", "--dtype", "fp16"]) == 0
    assert "wrote tiny (1.3 M parameters, fp16" in capsys.readouterr().out
    assert ModelConfig.from_pretrained(out).dtype == "fp16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"


def test_make_checkpoint_refuses_a_non_empty_dir_without_force(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out)]) == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    assert not (out / "config.json").exists()
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--force"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "keep me"


def test_make_checkpoint_bad_arguments(tmp_path, capsys):
    assert main(["make-checkpoint", "--preset", "llama-9", "--out", str(tmp_path / "x")]) == 2
    assert "unknown preset 'llama-9'; presets: tiny, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "y"), "--seed", "-1"])
    assert "must be an integer >= 0" in capsys.readouterr().err


def test_generate_streams_the_engines_tokens(tiny_checkpoint, capsys):
    from replicas.reference import ReferenceEngine

    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt).ids
    expected = list(ReferenceEngine.from_pretrained(tiny_checkpoint).generate(
        ids, SamplingParams(max_tokens=12, ignore_eos=True)))
    args = ["generate", "--model", str(tiny_checkpoint), prompt, "--max-tokens", "12", "--ignore-eos"]

    assert main(args + ["--tokens"]) == 0
    captured = capsys.readouterr()
    assert [int(t) for t in captured.out.split()] == expected
    assert "12 generated" in captured.err and "tokens/s" in captured.err and "finish=length" in captured.err

    assert main(args) == 0
    assert capsys.readouterr().out == tokenizer.decode(expected) + "\n"


def test_generate_bad_input(tmp_path, tiny_checkpoint, capsys):
    assert main(["generate", "--model", str(tiny_checkpoint), "hi", "--temperature", "-1"]) == 2
    assert "invalid sampling parameters: temperature" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    assert "tokenizer.json not found" in capsys.readouterr().err
    (tmp_path / "tokenizer.json").write_text((tiny_checkpoint / "tokenizer.json").read_text())
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_checkpoint), "hi", "--engine", "monokernel", "--devices", "x"]) == 2
    assert "--devices must be comma-separated GPU ordinals like 0,1; got 'x'" in capsys.readouterr().err


def test_streamed_text_never_splits_a_character(tiny_checkpoint):
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    text = "héllo wörld 😀 ∑ 中文 done"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # multi-byte characters span several byte tokens
    pieces = list(stream_text(tokenizer, tokenizer.encode("Say:").ids, iter(ids)))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # a character cut off at the end is flushed as U+FFFD, like a full decode
    cut = tokenizer.encode("ok 😀", add_special_tokens=False).ids[:-1]
    assert "".join(stream_text(tokenizer, [], iter(cut))) == tokenizer.decode(cut)


def test_generate_builds_the_batched_monokernel_when_asked(tiny_checkpoint, monokernel_builds, capsys):
    base = ["generate", "--model", str(tiny_checkpoint), "hi", "--engine", "monokernel", "--max-tokens", "3",
            "--tokens", "--ignore-eos"]
    assert main(base + ["--max-batch", "4"]) == 0
    assert main(base) == 0
    assert "3 generated" in capsys.readouterr().err
    assert [name for name, _ in monokernel_builds] == ["BatchedMonokernelEngine", "MonokernelEngine"]
    assert monokernel_builds[0][1] == {"batch": 4, "devices": [0], "resident": False, "session_cache_bytes": 2**30,
                                       "max_sessions": 64}


def test_generate_max_batch_refusals(tiny_checkpoint, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # a CPU machine: what it sees for the batched engine
    base = ["generate", "--model", str(tiny_checkpoint), "hi", "--engine", "monokernel"]
    assert main(base + ["--max-batch", "4"]) == 2
    assert "error: --engine monokernel needs CuPy and an NVIDIA GPU" in capsys.readouterr().err
    assert main(base + ["--max-batch", "9"]) == 2
    assert "error: --max-batch 9: the monokernel decodes at most 8 sequences together" in capsys.readouterr().err
    assert main(base + ["--max-batch", "2", "--devices", "0,1"]) == 2
    assert "error: --max-batch 2 with --devices 0,1: tensor parallelism and batching" in capsys.readouterr().err
    assert main(base + ["--max-batch", "0"]) == 2
    assert "error: --max-batch must be >= 1, got 0" in capsys.readouterr().err


def test_replica_resident_flag_needs_the_batched_monokernel(tiny_checkpoint, monokernel_builds):
    import argparse

    from replicas import cli_replica
    from replicas.cli_replica import EngineUnavailable

    p = argparse.ArgumentParser()
    cli_replica.add_arguments(p)
    base = ["--model", str(tiny_checkpoint), "--resident"]
    for extra in (["--engine", "reference", "--max-batch", "4"], ["--engine", "monokernel"]):
        with pytest.raises(EngineUnavailable, match="--resident is for the batched monokernel"):
            cli_replica.make_engine(p.parse_args(base + extra))
    cli_replica.make_engine(p.parse_args(base + ["--engine", "monokernel", "--max-batch", "2"]))
    assert monokernel_builds[-1] == ("BatchedMonokernelEngine", {"batch": 2, "devices": [0], "resident": True,
                                                                 "session_cache_bytes": 2**30, "max_sessions": 64})
