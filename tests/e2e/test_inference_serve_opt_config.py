"""``kolossos serve CONFIG.py`` with Energon-AI's documented ``opt_config.py`` keys, as a real
process: ``model_class = opt_125M`` (bare, as Energon writes it), a relative ``checkpoint``
folder holding a tiny OPT, ``tp_init_size = 2`` (two rank processes), ``host``/``port``,
``executor_max_batch_size``, ``cache_size``, ``cache_list_size``. Greedy completions equal
transformers' ``generate`` (also when a prompt is repeated with the result cache on); SIGTERM
ends both ranks.

The waits are hang detectors (minutes), not stopwatches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")
import transformers as tf
from test_inference_serve_pp import greedy_texts, serving, stop_and_check
from test_inference_serve_tp import build_folder, call, children_of, expected_text, free_port

pytestmark = pytest.mark.dist


def build_opt_folder(folder: Path) -> None:
    """A tiny OPT (4 heads: splittable over 2 ranks), the tp test's word-level tokenizer."""
    build_folder(folder)  # the tokenizer (and a GPT-2, replaced below)
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    torch.manual_seed(0)
    config = tf.OPTConfig(
        vocab_size=100, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=32, init_std=0.5,
        bos_token_id=99, eos_token_id=99, pad_token_id=0,
    )  # fmt: skip
    tf.OPTForCausalLM(config).save_pretrained(folder)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_serve_opt_config_py(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-opt"
    build_opt_folder(folder)
    port = free_port()
    config = tmp_path / "opt_config.py"
    config.write_text(
        "# Energon-AI's opt_config.py keys\n"
        "model_class = opt_125M\n"
        "checkpoint = 'tiny-opt'  # relative to this file\n"
        "tp_init_size = 2\n"
        "host = '127.0.0.1'\n"
        f"port = {port}\n"
        "executor_max_batch_size = 16\n"
        "cache_size = 50\n"
        "cache_list_size = 2\n"
    )
    log = tmp_path / "serve.log"
    with serving([str(config)], log, port=port) as (base, server):
        ranks = children_of(server.pid)
        assert len(ranks) == 1, ranks  # tp_init_size = 2: rank 1
        assert call(f"{base}/health")["model"] == "tiny-opt"
        greedy_texts(base, folder)
        body = {"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0}
        for _ in range(3):  # cache_list_size = 2: the third answer is a stored one
            got = call(f"{base}/v1/completions", body)["choices"][0]["text"]
            assert got == expected_text(folder, "w5 w6 w7", 8)
        stop_and_check(server, ranks, log)
