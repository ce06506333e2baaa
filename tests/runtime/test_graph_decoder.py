"""Static caches (device-side positions) and the CUDA-graph decoder against full recompute."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.kv.cache import LayerCache
from hearth.models.loading import build_model
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.runner import ModelRunner
from test_gemma4 import CONFIGS
from tiny import GEMMA4_SHARING, save_hf, tiny_gemma3_model, tiny_gemma4_model

# fp32, same math as the dynamic caches: summation order only (see test_gemma3_tiny, test_gemma4).
ATOL = 5e-5


def _model(kind: str, tmp_path: Path, device: str = "cpu") -> Any:
    hf = tiny_gemma3_model(seed=8) if kind == "gemma3" else tiny_gemma4_model(2, **CONFIGS[kind])
    return build_model(
        open_checkpoint(save_hf(hf, tmp_path)), torch.float32, device, progress=False
    )


@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing", "ple_sharing_double_wide"])
def test_static_caches_match_full_recompute(kind: str, tmp_path: Path) -> None:
    """20-token prefill (window 8), then decode steps whose position is a device tensor."""
    model = _model(kind, tmp_path)
    ids = torch.randint(4, 256, (1, 36), generator=torch.Generator().manual_seed(0))
    caches = [LayerCache.pinned_at(64, spec.window) for spec in model.cache_specs()]
    with torch.inference_mode():
        reference = model(ids)
        prefill = model(ids[:, :20], caches)
        steps = [model(ids[:, p : p + 1], caches, start=torch.tensor(p)) for p in range(20, 36)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), reference, atol=ATOL, rtol=0)
    assert caches[0].offset == 36


def _caches(model: Any, capacity: int = 64) -> list[LayerCache]:
    return [LayerCache.pinned_at(capacity, spec.window) for spec in model.cache_specs()]


def _same_caches_then_same_steps(
    model: Any, plain: list[LayerCache], padded: list[LayerCache], ids: torch.Tensor, held: int
) -> None:
    """Both cache lists hold `held` tokens at the same positions, values within ATOL; then,
    over the same values (the padded ones copied over), decode steps to the end of `ids`
    agree exactly."""
    for a, b in zip(plain, padded, strict=True):
        assert a.offset == b.offset == held
        assert torch.equal(a._positions, b._positions)
        for plane_a, plane_b in zip(a._planes, b._planes, strict=True):
            torch.testing.assert_close(plane_b, plane_a, atol=ATOL, rtol=0)
            plane_a.copy_(plane_b)
    for position in range(held, ids.shape[1]):
        step = ids[:, position : position + 1]
        start = torch.tensor(position)
        torch.testing.assert_close(
            model(step, padded, start=start), model(step, plain, start=start), atol=0, rtol=0
        )


@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing", "ple_sharing_double_wide"])
@pytest.mark.parametrize("padded", [13, 16, 20, 40])
def test_padded_first_chunk_acts_as_its_real_tokens(kind: str, padded: int, tmp_path: Path) -> None:
    """A 13-token prompt padded to 16, 20 or 40 tokens (the window is 8, so rings wrap and
    must keep the last real tokens, not the padding; 40 is past the full caches' 32 slots,
    which only padding would reach): the logits at its last real token, the
    caches' contents and every decode step after it equal the unpadded prompt's. Positions
    and counters exactly; values within ATOL (matmuls over more rows may sum in another
    order). The decode steps then run over the same stored values, so they must agree
    exactly: that checks the ring's bookkeeping without the prefill's rounding, which the
    steps would otherwise carry forward (and which differs with the CPU's GEMM kernels)."""
    model = _model(kind, tmp_path)
    ids = torch.randint(4, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    real = 13
    chunk = torch.cat([ids[:, :real], torch.zeros(1, padded - real, dtype=ids.dtype)], dim=1)
    plain, padded_caches = _caches(model, 32), _caches(model, 32)
    for cache in padded_caches:
        cache.real_tokens = torch.tensor(real)
    with torch.inference_mode():
        expected = model(ids[:, :real], plain, last_only=True)
        got = model(chunk, padded_caches, last_only=True, last_index=torch.tensor(real - 1))
        for cache in padded_caches:
            cache.real_tokens = None
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        _same_caches_then_same_steps(model, plain, padded_caches, ids, real)


@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing", "ple_sharing_double_wide"])
@pytest.mark.parametrize("padded", [9, 12, 20])
@pytest.mark.parametrize("real", [5, 9])
def test_padded_continuation_acts_as_its_real_tokens(
    kind: str, padded: int, real: int, tmp_path: Path
) -> None:
    """After 11 stored tokens, a chunk of 5 or 9 real tokens padded to 9, 12 or 20 (the
    window is 8: 5 new tokens leave 3 old ones in each ring, 9 wrap within the chunk itself)
    equals the unpadded chunk: logits at its last real token, positions and counters exactly,
    stored values within ATOL, then decode steps over the same stored values exactly (as for
    a padded first chunk, above)."""
    model = _model(kind, tmp_path)
    ids = torch.randint(4, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    cached = 11
    piece = ids[:, cached : cached + real]
    chunk = torch.cat([piece, torch.zeros(1, padded - real, dtype=ids.dtype)], dim=1)
    plain, padded_caches = _caches(model, 40), _caches(model, 40)
    with torch.inference_mode():
        for caches in (plain, padded_caches):
            model(ids[:, :cached], caches)
        expected = model(piece, plain, start=cached, last_only=True)
        for cache in padded_caches:
            cache.real_tokens = torch.tensor(real)
        start, last = torch.tensor(cached), torch.tensor(real - 1)
        got = model(chunk, padded_caches, start=start, last_only=True, last_index=last)
        for cache in padded_caches:
            cache.real_tokens = None
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        _same_caches_then_same_steps(model, plain, padded_caches, ids, cached + real)


def test_reset_to_zero_makes_a_cache_fresh(tmp_path: Path) -> None:
    """A cache reset to 0 (a graph runner reusing its caches for the next request) takes the
    next prompt as a fresh cache does: attended over its exact K/V, stale slots forgotten."""
    model = _model("gemma3", tmp_path)
    ids = torch.randint(4, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    used, fresh = _caches(model), _caches(model)
    with torch.inference_mode():
        model(ids[:1], used)
        for cache in used:
            cache.reset(0)
        torch.testing.assert_close(model(ids[1:], used), model(ids[1:], fresh), atol=0, rtol=0)
    assert all(torch.equal(a._positions, b._positions) for a, b in zip(used, fresh, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_decoder_matches_eager_on_gpu(tmp_path: Path) -> None:
    from hearth.runtime.graphs import GraphDecoder

    model = _model("gemma3", tmp_path, "cuda")
    ids = torch.randint(4, 256, (1, 300), device="cuda", generator=None)
    with torch.inference_mode():
        reference = model(ids)
    plan = replace(ExecutionPlan.for_device("cuda"), view_bucket=128)
    decoder = GraphDecoder(model, 512, plan)
    logits = [decoder.prefill(ids[:, :100])]
    logits += [decoder.step(ids[:, p : p + 1]) for p in range(100, 300)]  # crosses two buckets
    torch.testing.assert_close(torch.stack(logits, dim=1), reference[:, 99:], atol=ATOL, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_generate_loop_uses_graphs_on_gpu_with_the_same_tokens(tmp_path: Path) -> None:
    """generate_tokens decodes through CUDA graphs on a GPU, from its own static caches or
    from given dynamic ones (a prompt-cache hit, adopted); fp32 greedy tokens must equal a
    plain eager loop's (their logits differ by summation order only, ~1e-6)."""
    from hearth.kv import make_caches
    from hearth.runtime.generate import GenerationStats, generate_tokens
    from hearth.runtime.sampling import Sampler, SamplingParams

    model = _model("gemma3", tmp_path, "cuda")
    prompt = torch.randint(4, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    eager: list[int] = []
    caches = make_caches(model.cache_specs())
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device="cuda"), caches)[:, -1]
        for position in range(len(prompt), len(prompt) + 40):
            eager.append(int(logits.argmax()))
            step = torch.tensor([[eager[-1]]], device="cuda")
            logits = model(step, caches, start=position)[:, -1]
    greedy = Sampler(SamplingParams(), device="cuda")
    graphed = list(generate_tokens(model, prompt, greedy, 40, GenerationStats()))
    adopted = list(
        generate_tokens(
            model, prompt, greedy, 40, GenerationStats(), caches=make_caches(model.cache_specs())
        )
    )
    assert graphed == eager
    assert adopted == eager


@pytest.mark.parametrize("scheme", ["4", "8", "turbo:k8v3", "turbo:t4v3"])
@pytest.mark.parametrize("kind", ["gemma3", "gemma4_sharing"])
def test_quantized_static_caches_match_the_dynamic_ones(
    scheme: str, kind: str, tmp_path: Path
) -> None:
    """A static cache with a codec stores and attends exactly as the dynamic cache of that
    codec (first chunk exact, then everything as stored), through two prefill chunks that
    pass the window (8) and decode steps; only summation order differs (ATOL)."""
    from hearth.kv import parse_kv_quant

    policy = parse_kv_quant(scheme, group_size=32)
    if kind == "gemma3":
        hf = tiny_gemma3_model(seed=8, head_dim=32)
    else:
        hf = tiny_gemma4_model(3, **GEMMA4_SHARING)  # head_dim 32 sliding, 64 full; sharing
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, "cpu", False)
    ids = torch.randint(4, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    static = [
        LayerCache.pinned_at(64, spec.window, policy.codec_of(spec.index))
        for spec in model.cache_specs()
    ]
    dynamic = policy.make_caches(model.cache_specs())
    outputs = []
    for caches in (static, dynamic):
        with torch.inference_mode():
            logits = [model(ids[:, :12], caches), model(ids[:, 12:24], caches, start=12)]
            logits += [model(ids[:, p : p + 1], caches, start=p) for p in range(24, 40)]
        outputs.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(outputs[0], outputs[1], atol=ATOL, rtol=0)
    # And quantization did happen: the logits differ from a dense cache's.
    with torch.inference_mode():
        dense = model(ids)
    assert (outputs[0] - dense).abs().max() > 1e-3
    assert static[0].signature() == dynamic[0].signature()


def test_decode_steps_writing_kv_from_the_rope_kernel_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU decode path where the norm + RoPE step writes K/V into the static cache
    (its torch reference here, the Triton kernel on a GPU) gives the same logits as the
    path that returns K/V and appends them."""
    import hearth.kv.cache as static_module

    model = _model("gemma3", tmp_path)
    ids = torch.randint(4, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    outputs = []
    for direct in (False, True):
        if direct:  # let dense static caches hand out their buffers as on a GPU
            monkeypatch.setattr(static_module, "kernel_enabled", lambda tensor: True)
        caches = [LayerCache.pinned_at(64, spec.window) for spec in model.cache_specs()]
        with torch.inference_mode():
            logits = [model(ids[:, :20], caches)]
            logits += [
                model(ids[:, p : p + 1], caches, start=torch.tensor(p)) for p in range(20, 30)
            ]
        outputs.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(outputs[1], outputs[0], atol=ATOL, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("scheme", ["4", "turbo:k8v3", "turbo:t4v3"])
def test_graph_decode_over_quantized_caches_on_gpu(scheme: str, tmp_path: Path) -> None:
    """The graph path with a quantized KV policy (static caches holding codec planes, the
    attention kernel reading them) picks the same greedy tokens as an eager loop over the
    dynamic caches of that policy (fp32; logits differ by summation order only)."""
    from hearth.kv import parse_kv_quant
    from hearth.runtime.generate import GenerationStats, generate_tokens
    from hearth.runtime.sampling import Sampler, SamplingParams

    policy = parse_kv_quant(scheme, group_size=32)
    hf = tiny_gemma3_model(seed=8, head_dim=32)
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, "cuda", False)
    prompt = torch.randint(4, 256, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    eager: list[int] = []
    caches = policy.make_caches(model.cache_specs())
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device="cuda"), caches)[:, -1]
        for position in range(len(prompt), len(prompt) + 30):
            eager.append(int(logits.argmax()))
            step = torch.tensor([[eager[-1]]], device="cuda")
            logits = model(step, caches, start=position)[:, -1]
    greedy = Sampler(SamplingParams(), device="cuda")
    runner = ModelRunner(model, kv_policy=policy)
    graphed = list(generate_tokens(runner, prompt, greedy, 30, GenerationStats()))
    assert graphed == eager


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter path; on a GPU the graph test covers it"
)
@pytest.mark.parametrize("scheme", ["4", "8", "turbo:k8v3", "turbo:t4v3"])
def test_quantized_decode_steps_through_the_append_kernel_match(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of a quantized static cache whose token is coded and stored by the
    Triton kernels (interpreted here) and attended by the decode kernel over the stored
    planes give the logits of the torch path (fp32: the affine append equals quantize_affine
    bit for bit, the TurboQuant one stores the codec's codes; the attention kernel differs by
    summation order and exp2, bounded at 1e-4 in tests/layers/test_attention_kernel_path.py)."""
    import hearth.kv.cache as static_module
    from hearth.kv import parse_kv_quant
    from hearth.layers import attention as gemma

    policy = parse_kv_quant(scheme, group_size=32)
    hf = tiny_gemma3_model(seed=8, head_dim=32)
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, "cpu", False)
    # Five interpreted steps (positions 20-24) take the sliding layers' ring of 8 past its
    # last slot and back to slot 0.
    ids = torch.randint(4, 256, (1, 25), generator=torch.Generator().manual_seed(6))
    outputs = []
    for kernel in (False, True):
        if kernel:
            monkeypatch.setattr(static_module, "kernel_enabled", lambda tensor: True)
            monkeypatch.setattr(gemma, "kernel_enabled", lambda tensor: True)
            # Dense-only shortcuts stay off: this test is about the affine kernel.
            monkeypatch.setattr(static_module.LayerCache, "decode_write", lambda self, p: None)
        caches = [
            LayerCache.pinned_at(64, spec.window, policy.codec_of(spec.index))
            for spec in model.cache_specs()
        ]
        with torch.inference_mode():
            logits = [model(ids[:, :20], caches)]
            for p in range(20, 25):
                logits.append(model(ids[:, p : p + 1], caches, start=torch.tensor(p)))
        outputs.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=0)


def test_runners_reuse_their_decoder_when_it_fits(tmp_path: Path) -> None:
    """`acquire_decoder` hands back the runner's idle decoder (emptied: fresh caches, length
    0) when it holds the context; a new one otherwise. Runners of one model share nothing."""
    model = _model("gemma3", tmp_path)
    runner = ModelRunner(model)
    first = runner.acquire_decoder(100)
    runner.release_decoder(first)
    assert ModelRunner(model).acquire_decoder(100) is not first  # another runner's
    assert runner.acquire_decoder(100) is first
    with torch.inference_mode():
        first.prefill(torch.randint(4, 256, (1, 12)))
    assert first.length == 12 and not first.caches[0].is_fresh
    runner.release_decoder(first)
    again = runner.acquire_decoder(200)
    assert again is first and again.length == 0
    assert all(cache.is_fresh and cache.offset == 0 for cache in again.caches)
    runner.release_decoder(again)
    assert runner.acquire_decoder(1000) is not first  # too short for this request
    runner.release_decoder(first)
    runner.discard_idle()
    assert runner.acquire_decoder(100) is not first


def test_a_decoder_that_replaces_a_smaller_one_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation's growing requests: a decoder replacing an idle one too small for its
    request takes twice the idle one's slots, in whole 256-slot buckets, within the model's
    positions (4096 here), the slot limit and half the device's free memory beyond what the
    request needs; a new KV policy (another runner) starts at its own size."""
    from hearth.kv import parse_kv_quant
    from hearth.runtime import graphs as cuda_graph

    hf = tiny_gemma3_model(seed=8, max_position_embeddings=4096)
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, progress=False)
    runner = ModelRunner(model)

    def turn(needed: int, on: ModelRunner = runner) -> Any:
        decoder = on.acquire_decoder(needed)
        on.release_decoder(decoder)
        return decoder

    first = turn(100)
    assert first.max_context == 256  # the request's own size, rounded up to a bucket
    second = turn(300)
    assert second is not first and second.max_context == 512  # 2 x 256
    assert turn(500) is second  # the next turn fits
    assert turn(600).max_context == 1024
    runner.slot_limit = 1800
    grown = turn(1100)
    assert grown.max_context == 1792  # not 2 x 1024: whole buckets under the limit of 1800
    assert turn(1600) is grown
    runner.slot_limit = 1000
    assert turn(2200).max_context == 2304  # a limit never cuts the request's own size
    runner.slot_limit = None
    assert turn(2400).max_context == 4096  # not 2 x 2304: the model's 4096 positions
    quantized = ModelRunner(model, kv_policy=parse_kv_quant("8", group_size=32))
    assert turn(100, quantized).max_context == 256
    config = model.config  # fp32 K and V of the 2 full layers: the bytes one slot adds
    full_layers = config.layer_types.count("full_attention")
    slot = 2 * config.num_key_value_heads * config.head_dim * 4 * full_layers
    assert full_layers == 2 < config.num_hidden_layers  # the sliding rings take no more
    monkeypatch.setattr(cuda_graph, "device_free_bytes", lambda device: 2 * 100 * slot)
    runner.discard_idle()
    assert turn(300).max_context == 512
    assert turn(600).max_context == 768  # not 2 x 512: 600 + 100 slots, the request rounded
    monkeypatch.setattr(cuda_graph, "device_free_bytes", lambda device: 2 * 450 * slot)
    runner.discard_idle()
    assert turn(300).max_context == 512
    # 600 + 450 slots: 2 x 512 fits (every layer a slot would have allowed 600 + 225: 768).
    assert turn(600).max_context == 1024


def test_prefill_graph_buckets(tmp_path: Path) -> None:
    """Which prompts a graph prefills, and at what padded length: only where the plan has
    prefill graphs, on a fresh decoder, one chunk long, dense caches."""
    from hearth.kv import parse_kv_quant
    from hearth.runtime import graphs as cuda_graph

    model = _model("gemma3", tmp_path)
    graphs = ExecutionPlan("cuda", prefill_graphs=True)
    off = cuda_graph.GraphDecoder(model, 600, replace(graphs, prefill_graphs=False))
    assert off._prefill_bucket(100, 512) is None  # the plan has none
    decoder = cuda_graph.GraphDecoder(model, 600, graphs)
    assert decoder._prefill_bucket(100, 512) == 128
    assert decoder._prefill_bucket(64, 512) == 64
    # Longer than the 600 slots: only the real tokens are stored, and they fit.
    assert decoder._prefill_bucket(599, 1024) == 768
    assert decoder._prefill_bucket(2100, 4096) == 3072  # half steps past 512
    assert decoder._prefill_bucket(513, 512) is None  # two chunks
    decoder.length = 5
    assert decoder._prefill_bucket(100, 512) is None  # not a fresh decoder (see below)
    policy = parse_kv_quant("8", group_size=32)
    quantized = cuda_graph.GraphDecoder(model, 600, graphs, policy)
    assert quantized._prefill_bucket(100, 512) is None
    # After held tokens (a prompt-cache hit): only with continuation graphs, and only where
    # the full caches (768 slots) hold the padded chunk.
    decoder.length = 500
    assert decoder._prefill_bucket(100, 512) is None
    continuing = replace(graphs, continuation_graphs=True)
    decoder = cuda_graph.GraphDecoder(model, 600, continuing)
    decoder.length = 500
    assert decoder._prefill_bucket(100, 512) == 128
    assert decoder._prefill_bucket(260, 512) is None  # 500 + 512 slots would not fit
    quantized = cuda_graph.GraphDecoder(model, 600, continuing, policy)
    quantized.length = 500
    assert quantized._prefill_bucket(100, 512) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing"])
def test_prefill_graphs_match_eager_on_gpu(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 13, 50 and 64 tokens (bucket 64: padded, and exact; the window is 8) from
    one reused decoder, then decode steps: logits equal the eager path's. The first prompt
    prefills eagerly (a bucket's first sighting), the second captures, the rest replay."""
    from hearth.runtime import graphs as cuda_graph

    model = _model(kind, tmp_path, "cuda")
    runner = ModelRunner(model)  # the device's plan: prefill graphs on
    for prompt, tokens in enumerate((13, 50, 64, 13)):
        ids = torch.randint(4, 256, (1, tokens + 8), device="cuda")
        with torch.inference_mode():
            reference = model(ids)
        decoder = runner.acquire_decoder(256)
        logits = [decoder.prefill(ids[:, :tokens])]
        assert (64 in decoder._prefill_graphs) == (prompt > 0)
        logits += [decoder.step(ids[:, p : p + 1]) for p in range(tokens, tokens + 8)]
        runner.release_decoder(decoder)
        expected = reference[:, tokens - 1 :]
        torch.testing.assert_close(torch.stack(logits, dim=1), expected, atol=ATOL, rtol=0)
    small = cuda_graph.GraphDecoder(model, 24)  # bucket 64 is longer than its 24 slots
    ids = torch.randint(4, 256, (1, 21), device="cuda")
    with torch.inference_mode():
        reference = model(ids)
    for _ in range(3):  # eager, then captured, then replayed
        small.reset()
        logits = [small.prefill(ids[:, :13])]
        logits += [small.step(ids[:, p : p + 1]) for p in range(13, 21)]
        torch.testing.assert_close(torch.stack(logits, 1), reference[:, 12:], atol=ATOL, rtol=0)
    assert small.graph_bucket == 64


@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing"])
def test_decoder_prefill_continues_after_adopt(kind: str, tmp_path: Path) -> None:
    """A prompt-cache hit as generate runs it with continuation graphs: the hit's 20 tokens
    adopted from dynamic caches, its 13 new ones prefilled by the decoder after them (eagerly
    here: positions from 20 on), then decode steps: logits match a full recompute."""
    from hearth.kv.cache import make_caches
    from hearth.runtime.graphs import GraphDecoder

    model = _model(kind, tmp_path)
    ids = torch.randint(4, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    dynamic = make_caches(model.cache_specs())
    decoder = GraphDecoder(model, 64)
    with torch.inference_mode():
        reference = model(ids)
        model(ids[:, :20], dynamic)
        decoder.adopt(dynamic, 20)
        logits = [decoder.prefill(ids[:, 20:33], chunk=8)]  # two chunks: 8, then 5
        assert decoder.length == 33
        steps = [
            model(ids[:, p : p + 1], decoder.caches, start=torch.tensor(p)) for p in range(33, 40)
        ]
    got = torch.cat([logits[0][:, None], *steps], dim=1)
    torch.testing.assert_close(got, reference[:, 32:], atol=ATOL, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing"])
def test_continuation_graphs_match_eager_on_gpu(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt-cache hits of 20 tokens, then 13 (padded to 64) or 64 new tokens, prefilled by
    one reused decoder from a continuation graph (eager the first time per bucket, captured
    the second, replayed after), then decode steps: logits match a full recompute."""
    from hearth.kv.cache import make_caches

    model = _model(kind, tmp_path, "cuda")
    runner = ModelRunner(model)  # the device's plan: continuation graphs on
    for attempt, new in enumerate((13, 13, 64, 13)):
        ids = torch.randint(4, 256, (1, 20 + new + 8), device="cuda")
        dynamic = make_caches(model.cache_specs())
        with torch.inference_mode():
            reference = model(ids)
            model(ids[:, :20], dynamic)
        decoder = runner.acquire_decoder(256)
        decoder.adopt(dynamic, 20)
        logits = [decoder.prefill(ids[:, 20 : 20 + new])]
        assert (64 in decoder._continuation_graphs) == (attempt > 0)
        end = 20 + new
        logits += [decoder.step(ids[:, p : p + 1]) for p in range(end, end + 8)]
        runner.release_decoder(decoder)
        expected = reference[:, end - 1 :]
        torch.testing.assert_close(torch.stack(logits, dim=1), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing"])
def test_snapshot_of_pinned_caches_continues_as_eager_caches(kind: str, tmp_path: Path) -> None:
    """The server keeps a prompt's caches for its next turn: a graph decoder's pinned caches
    (a 20-token prompt; the window is 8, so the rings have wrapped) become eager caches
    holding the same tokens as stored, and decoding from them matches a full recompute."""
    from hearth.kv.prompt_cache import snapshot_caches
    from hearth.runtime.graphs import GraphDecoder

    model = _model(kind, tmp_path)
    ids = torch.randint(4, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    decoder = GraphDecoder(model, 64)
    with torch.inference_mode():
        reference = model(ids)
        decoder.prefill(ids[:, :20])
        snapshot = snapshot_caches(decoder.caches)
        for pinned, kept in zip(decoder.caches, snapshot, strict=True):
            assert pinned.pinned and not kept.pinned
            assert kept.offset == 20 and kept.signature() == pinned.signature()
            before, after = pinned.contents().positions, kept.contents().positions
            assert sorted(after[after < 2**62].tolist()) == sorted(before[before < 2**62].tolist())
        decoder.reset()  # the snapshot owns its tensors: the decoder's next request may go on
        steps = [model(ids[:, p : p + 1], snapshot, start=p) for p in range(20, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), reference[:, 20:], atol=ATOL, rtol=0)


def test_caches_load_only_what_they_can_hold() -> None:
    """A full-attention cache holds positions from 0; a load goes into an empty cache of the
    same layout only."""
    from hearth.kv.cache import LayerCache
    from hearth.quant.kv_codecs import AffineCodec

    keys = torch.randn(1, 2, 12, 32)
    ring = LayerCache(8)
    ring.update_and_fetch(keys, keys.clone())
    with pytest.raises(ValueError, match="from 0, not from 4"):
        LayerCache().load(ring.contents())  # the ring holds positions 4..11
    with pytest.raises(ValueError, match="cannot load"):
        LayerCache(8, AffineCodec(8, 32)).load(ring.contents())
    again = LayerCache(8)
    again.load(ring.contents())
    assert again.offset == 12
    torch.testing.assert_close(again.contents().stored.planes[0], ring.contents().stored.planes[0])
    with pytest.raises(ValueError, match="empty cache only"):
        again.load(ring.contents())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("kind", ["gemma3", "kv_sharing"])
def test_prompt_cache_round_trip_through_graph_prefill_on_gpu(kind: str, tmp_path: Path) -> None:
    """As the server runs a conversation on a GPU: a fresh prompt prefilled by the reused
    decoder (eagerly, then from a captured graph, then replayed), kept as a dynamic snapshot,
    and the next turn adopting that snapshot to decode: logits match a full recompute."""
    from hearth.kv.prompt_cache import snapshot_caches

    model = _model(kind, tmp_path, "cuda")
    ids = torch.randint(4, 256, (1, 30), device="cuda")
    with torch.inference_mode():
        reference = model(ids)
    runner = ModelRunner(model)
    for _ in range(3):
        decoder = runner.acquire_decoder(64)
        first = decoder.prefill(ids[:, :20])
        snapshot = snapshot_caches(decoder.caches)
        runner.release_decoder(decoder)
        decoder = runner.acquire_decoder(64)
        decoder.adopt(snapshot, 20)
        logits = [first] + [decoder.step(ids[:, p : p + 1]) for p in range(20, 30)]
        runner.release_decoder(decoder)
        torch.testing.assert_close(torch.stack(logits, 1), reference[:, 19:], atol=ATOL, rtol=0)
