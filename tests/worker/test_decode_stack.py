"""The native decode stack (``worker/models/decode_stack.py``, ``decode_stack.cpp``): a decode
step through it (embedding, layers, head) computes bit for bit what the model's modules
compute, with every kernel kind a linear can take, and it steps aside wherever it does not
apply."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import make_engine, make_prompts, other_dtype
from worker import SamplingParams
from worker.kernels import has_native_kernels
from worker.models.decode_stack import BRGEMM, INT8, INVARIANT, ONEDNN, QUANT, DecodeStack

pytestmark = [pytest.mark.skipif(not has_native_kernels(), reason="the native CPU kernels are not built here"),
              pytest.mark.isa]  # the linears' kernels differ by ISA level: CI runs this file again capped to AVX2


def decoding_engine(path, batch: int, monkeypatch, activations: str = "auto", **options):
    """An engine whose ``batch`` sequences have all finished their prompts."""
    monkeypatch.setenv("KERVAN_QUANT_ACTIVATIONS", activations)
    engine = make_engine(path, **options)
    for prompt in make_prompts([5 + 3 * i for i in range(batch)], seed=batch):
        engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    return engine


def next_step_inputs(engine):
    """The inputs of the engine's next step (which it runs)."""
    runner, seen = engine.runner, []
    forward = runner.forward
    runner.forward = lambda step, *args, **kw: seen.append(step) or forward(step, *args, **kw)
    try:
        engine.step()
    finally:
        del runner.forward
    return seen[0]


def both_paths(engine, step) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits through the stack, then through the modules (each writes the same
    K/V into the same slots)."""
    model = engine.runner.model
    stack = model.decode_stack
    assert stack is not None and stack.serves(step)
    with_stack = engine.runner.forward(step)
    model.decode_stack = None
    try:
        return with_stack, engine.runner.forward(step)
    finally:
        model.decode_stack = stack


def kinds(engine) -> set[int]:
    from worker.models.decode_stack import linear_spec
    model = engine.runner.model
    return {linear_spec(m)[0] for layer in model.layers
            for m in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: attention biases in the qkv kernel, a tied head
@pytest.mark.parametrize("options,activations", [
    ({"dtype": "float32"}, "auto"),
    ({"dtype": other_dtype()}, "auto"),
    ({"dtype": "float32", "quantization": "int4-g32"}, "int8"),
    ({"dtype": "bfloat16", "quantization": "int4-g32"}, "float"),
    ({"dtype": "float32", "quantization": "int8"}, "int8"),
], ids=["float32", "other-dtype", "int4-int8-activations", "int4-float-kernel", "int8-weights"])
@pytest.mark.parametrize("batch", [3, 9])
def test_a_decode_step_through_the_stack_is_bit_for_bit_the_modules(hf_models, kind, options, activations, batch,
                                                                    monkeypatch):
    _, path = hf_models(kind)
    engine = decoding_engine(path, batch, monkeypatch, activations, **options)
    expected = {"int8": {INT8}, "float": {QUANT}}.get(activations if "quantization" in options else "",
                                                      {BRGEMM, INVARIANT})
    assert kinds(engine) <= expected
    step = next_step_inputs(engine)
    assert not step.prefills and len(step.token_ids) == batch
    with_stack, with_modules = both_paths(engine, step)
    assert with_stack.shape == (batch, 128)
    assert torch.equal(with_stack, with_modules)


def test_a_whole_generation_is_the_same_with_the_stack_off(llama, monkeypatch):
    _, path = llama
    prompts = make_prompts([7, 19, 4], seed=3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    on = make_engine(path)
    assert on.runner.model.decode_stack is not None
    monkeypatch.setenv("KERVAN_DECODE_STACK", "off")
    off = make_engine(path)
    assert off.runner.model.decode_stack is None
    assert [o.token_ids for o in on.generate(prompts, params)] == [o.token_ids for o in off.generate(prompts, params)]


def test_steps_with_prompt_rows_take_the_modules_and_decode_steps_of_any_size_the_stack(llama, monkeypatch):
    _, path = llama
    engine = decoding_engine(path, 2, monkeypatch, "float", quantization="int4-g32")
    stack = engine.runner.model.decode_stack
    served, run = [], DecodeStack.run
    monkeypatch.setattr(DecodeStack, "run", lambda self, step: served.append(len(step.token_ids)) or run(self, step))
    engine.step()  # two decode rows
    engine.add_request(make_prompts([9])[0], SamplingParams(max_tokens=2, temperature=0))
    engine.step()  # the prompt's rows with them: the modules
    assert served == [2]
    step = next_step_inputs(engine)
    assert stack.serves(step) and stack.serves(replace(step, token_ids=step.token_ids * 40))


def test_onednns_layout_is_a_kernel_the_stack_takes_too(llama, monkeypatch):
    """``KERVAN_WEIGHT_PACKING=onednn`` (a benchmark's baseline): the stack calls oneDNN's linear
    as the modules do."""
    _, path = llama
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "onednn")
    engine = decoding_engine(path, 3, monkeypatch, dtype="float32")
    assert kinds(engine) == {ONEDNN}
    step = next_step_inputs(engine)
    with_stack, with_modules = both_paths(engine, step)
    assert torch.equal(with_stack, with_modules)


def test_the_rows_that_sample_are_the_logits_it_returns(llama, monkeypatch):
    """n > 1 samples a row several times, speculative steps sample rows out of order: the
    head takes the rows ``logit_rows`` names, as the modules' path does."""
    _, path = llama
    engine = decoding_engine(path, 3, monkeypatch)
    step = next_step_inputs(engine)
    for rows in ([2, 0, 0, 1], [1], []):
        with_stack, with_modules = both_paths(engine, replace(step, logit_rows=rows))
        if not rows:
            assert with_stack is None and with_modules is None
        else:
            assert with_stack.shape == (len(rows), 128) and torch.equal(with_stack, with_modules)


def test_no_stack_for_moe_layers(hf_models):
    _, path = hf_models("mixtral")
    assert make_engine(path).runner.model.decode_stack is None
