"""`monoserve bench` forwards to the bench scripts; cluster subcommands reject bad input clearly."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def monoserve(*args):
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=120, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}", "PATH": "/usr/bin:/bin"})


def test_bench_forwards_arguments_to_the_script():
    done = monoserve("bench", "router", "--help")
    assert done.returncode == 0 and "usage: router.py" in done.stdout


def test_bench_names_the_allowed_scripts():
    done = monoserve("bench", "nope")
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr
    assert "decode" in done.stderr and "router" in done.stderr


def test_up_without_a_model_says_what_to_give():
    done = monoserve("up")
    assert done.returncode == 2 and "model is required" in done.stderr


def test_up_with_a_bad_config_file_names_the_field(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m\nreplicas: {min: 3, max: 1}\n")
    done = monoserve("up", "--config", str(cfg))
    assert done.returncode == 2 and "replicas: min (3) is larger than max (1)" in done.stderr


def test_local_cluster_too_small_for_the_replicas_is_refused_before_anything_starts(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m\nengine: reference\nreplicas: {min: 2, max: 2}\nray: {num_gpus: 8, num_cpus: 2}\n")
    done = monoserve("up", "--config", str(cfg))
    assert done.returncode == 2
    assert "the Ray cluster has 8 GPUs but 2 replicas x 8 GPUs are needed" in done.stderr
