"""Beyond the zoo: many transformers architectures at small configs (random weights, no download), each through
what a new user's first `kernelfuse optimize` does on a machine without a GPU: load, capture, plan, the CPU check
(every plan interpreted against eager, every emitted file run) and nvcc on the first variant's CUDA.

    PYTHONPATH=. python benchmarks/hf_sweep.py [OUT.md] [--only mistral,qwen2]

One problem file per architecture is written to a temporary folder (the template below); the table gives each one's
outcome, its variants and how many carry generated kernels. Needs transformers (the `zoo` extra) and, for the nvcc
column, CUDA's nvcc on PATH. The zoo (benchmarks/zoo) stays the measured set; this sweep is the wide, shallow one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kernelfuse.fuzz import device
from kernelfuse.fuzz.run import run_problem

TEMPLATE = '''import torch
import torch.nn as nn
import transformers as T


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = T.{model}(T.{config}({kwargs})).eval()

    def forward(self, {arg}):
        return self.model({arg}={arg}{extra}).last_hidden_state


def get_inputs():
    return [{inputs}]


def get_init_inputs():
    return []
'''
IDS, PIXELS = "torch.randint(0, 1000, (2, 32))", "torch.randn(2, 3, 64, 64)"
DECODER = ("hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000, "
           "max_position_embeddings=128, attn_implementation='sdpa'")
ENCODER = "hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4"
NO_CACHE = ", use_cache=False"
# name: (config class, model class, config keywords, extra forward keywords, inputs)
ARCHITECTURES: dict[str, tuple[str, str, str, str, str]] = {
    "mistral": ("MistralConfig", "MistralModel", DECODER + ", num_key_value_heads=2", NO_CACHE, IDS),
    "qwen2": ("Qwen2Config", "Qwen2Model", DECODER + ", num_key_value_heads=2", NO_CACHE, IDS),
    "qwen3": ("Qwen3Config", "Qwen3Model", DECODER + ", num_key_value_heads=2, head_dim=32", NO_CACHE, IDS),
    "phi3": ("Phi3Config", "Phi3Model", DECODER + ", num_key_value_heads=2, pad_token_id=0", NO_CACHE, IDS),
    "gemma": ("GemmaConfig", "GemmaModel", DECODER + ", num_key_value_heads=2, head_dim=32", NO_CACHE, IDS),
    "gemma2": ("Gemma2Config", "Gemma2Model",  # transformers refuses sdpa for Gemma2: its eager attention
               DECODER.replace("'sdpa'", "'eager'") + ", num_key_value_heads=2, head_dim=32", NO_CACHE, IDS),
    "starcoder2": ("Starcoder2Config", "Starcoder2Model", DECODER + ", num_key_value_heads=2", NO_CACHE, IDS),
    "olmo": ("OlmoConfig", "OlmoModel", DECODER + ", num_key_value_heads=2", NO_CACHE, IDS),
    "mixtral": ("MixtralConfig", "MixtralModel",
                DECODER + ", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2", NO_CACHE, IDS),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", DECODER, NO_CACHE, IDS),
    "gptj": ("GPTJConfig", "GPTJModel", "n_embd=128, n_layer=2, n_head=4, rotary_dim=16, vocab_size=1000, "
             "n_positions=128, bos_token_id=0, eos_token_id=0", NO_CACHE, IDS),
    "falcon": ("FalconConfig", "FalconModel", "hidden_size=128, num_hidden_layers=2, num_attention_heads=4, "
               "vocab_size=1000, attn_implementation='sdpa'", NO_CACHE, IDS),
    "bloom": ("BloomConfig", "BloomModel", "hidden_size=128, n_layer=2, n_head=4, vocab_size=1000", NO_CACHE, IDS),
    "opt": ("OPTConfig", "OPTModel", "hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, "
            "vocab_size=1000, max_position_embeddings=128, word_embed_proj_dim=128, attn_implementation='sdpa'",
            NO_CACHE, IDS),
    "roberta": ("RobertaConfig", "RobertaModel", ENCODER + ", vocab_size=1000, attn_implementation='sdpa'", "", IDS),
    "distilbert": ("DistilBertConfig", "DistilBertModel", "dim=128, hidden_dim=256, n_layers=2, n_heads=4, "
                   "vocab_size=1000, attn_implementation='sdpa'", "", IDS),
    "albert": ("AlbertConfig", "AlbertModel", ENCODER + ", embedding_size=64, vocab_size=1000", "", IDS),
    "electra": ("ElectraConfig", "ElectraModel", ENCODER + ", embedding_size=64, vocab_size=1000", "", IDS),
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", ENCODER + ", vocab_size=1000", "", IDS),
    "mpnet": ("MPNetConfig", "MPNetModel", ENCODER + ", vocab_size=1000", "", IDS),
    "t5_encoder": ("T5Config", "T5EncoderModel", "d_model=128, d_ff=256, d_kv=32, num_layers=2, num_heads=4, "
                   "vocab_size=1000", "", IDS),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", ENCODER + ", image_size=64, patch_size=16", "", PIXELS),
    "dinov2": ("Dinov2Config", "Dinov2Model", ENCODER + ", image_size=64, patch_size=16", "", PIXELS),
    "segformer": ("SegformerConfig", "SegformerModel", "num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], "
                  "hidden_sizes=[32, 64], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], "
                  "mlp_ratios=[2, 2]", "", PIXELS),
}


def problem_text(name: str) -> str:
    """The problem file of one architecture."""
    config, model, kwargs, extra, inputs = ARCHITECTURES[name]
    arg = "pixel_values" if inputs == PIXELS else "input_ids"
    return TEMPLATE.format(model=model, config=config, kwargs=kwargs, arg=arg, extra=extra, inputs=inputs)


def sweep_one(path: Path, nvcc: str | None) -> str:
    """One table row's cells after the name: outcome, variants, with kernels, nvcc, seconds."""
    start = time.time()
    run = run_problem(path)
    cudas = [e.cuda for e in run.emitted or [] if e.cuda]
    outcome = "ok" if run.outcome.status == "ok" else run.outcome.describe().replace("|", "/")[:300]
    compiled = "-"
    if run.outcome.status == "ok" and cudas and nvcc:
        errors = device.compile_all([cudas[0]], nvcc)
        compiled = "ok" if not errors else "FAIL: " + next(iter(errors.values()))[:200]
    return f"{outcome} | {len(run.emitted or [])} | {len(cudas)} | {compiled} | {time.time() - start:.0f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="the table as markdown")
    parser.add_argument("--only", default="", help=f"comma-separated names of {', '.join(ARCHITECTURES)}")
    opts = parser.parse_args(argv)
    names = [n for n in opts.only.split(",") if n] or list(ARCHITECTURES)
    if unknown := set(names) - set(ARCHITECTURES):
        parser.error(f"unknown architectures {sorted(unknown)}")
    nvcc = device.find_nvcc()
    rows = ["| architecture | outcome | variants | with kernels | nvcc (first variant) | s |",
            "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="kernelfuse_hf_sweep_") as tmp:
        for name in names:
            path = Path(tmp) / f"{name}.py"
            path.write_text(problem_text(name))
            rows.append(f"| {name} | {sweep_one(path, nvcc)} |")
            print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if opts.out:
        Path(opts.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
