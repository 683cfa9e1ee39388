"""What walking ``model.parameters()`` costs per call, which clipping did on every step before
``corelooper.gradients.parameters_of`` kept the list (no download: models built from configs).

usage: python benchmarks/parameters_walk.py [--calls N]
Prints µs per call of ``list(model.parameters())`` and of ``parameters_of(model)`` for workload
A's MLP, a 28-layer Llama (Qwen-7B's depth, small widths: the walk depends on the module count,
not the sizes) and the same with PEFT LoRA on every linear layer.
"""

import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "overhead"))


def per_call_us(fn, calls):
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def models():
    import common as C

    yield "workload A MLP", C.make_model("A")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    yield "Llama, 28 layers", LlamaForCausalLM(cfg)
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(r=8, target_modules="all-linear"))
    yield "Llama, 28 layers + LoRA on every linear", lora


def main():
    from corelooper.gradients import parameters_of

    calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 200
    torch.set_num_threads(1)
    print(
        f"{'model':42s} {'modules':>7s} {'params':>6s} {'walk us':>8s} {'kept us':>8s}  (load {os.getloadavg()[0]:.2f})"
    )
    for name, model in models():
        walk = per_call_us(lambda m=model: list(m.parameters()), calls)
        kept = per_call_us(lambda m=model: parameters_of(m), calls)
        print(
            f"{name:42s} {len(list(model.modules())):7d} {len(list(model.parameters())):6d} {walk:8.1f} {kept:8.2f}"
        )


if __name__ == "__main__":
    main()
