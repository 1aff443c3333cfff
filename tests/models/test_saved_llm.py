"""LLM.save, and kiln.models.load / `kiln generate` of the saved directory: the same tokens
as the LLM that was saved (and as transformers), with no compiling, and every bad
directory or mismatched argument a clear error before any weight is read."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

import kiln
import kiln.artifact.weights as weights_mod
import kiln.models
from kiln.cli import main
from kiln.errors import ArgumentError, ArtifactError
from tests.models.support import run_alone, run_batched

FAMILY = "llama3.1"


@pytest.fixture(scope="module")
def saved(llms, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "llama.kiln"
    llms(FAMILY).save(path)
    return path


def _no_compiling(mp):
    mp.setattr(kiln, "compile", lambda *a, **k: pytest.fail("loading compiled"))


@pytest.fixture(scope="module")
def loaded(saved):
    with pytest.MonkeyPatch.context() as mp:
        _no_compiling(mp)
        return kiln.models.load(saved)


def test_loaded_llm_generates_the_tokens_of_the_saved_one_and_of_transformers(
        checkpoints, llms, loaded):
    _, hf_model = checkpoints[FAMILY]
    prompt = torch.randint(3, loaded.cfg.vocab_size, (7,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    ours = loaded.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert ours.ids == llms(FAMILY).generate(prompt, max_new_tokens=24, ignore_eos=True).ids
    ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    assert ours.ids == ref[0, len(prompt):].tolist() and len(set(ours.ids)) >= 8
    batch = [[5, 6, 7, 8, 9], [11, 12]]
    assert [g.ids for g in loaded.generate(batch, max_new_tokens=6)] == \
        [g.ids for g in llms(FAMILY).generate(batch, max_new_tokens=6)]
    assert loaded.generate("kiln compiles", max_new_tokens=6).text == \
        llms(FAMILY).generate("kiln compiles", max_new_tokens=6).text


def test_prefill_and_decode_share_the_loaded_kv_cache(llms, loaded):
    """Decode reads what prefill wrote: logits equal the saved LLM's, bit for bit."""
    prompt, steps = torch.tensor([3, 9, 27, 81 % 90, 50]), torch.tensor([4, 8, 15])
    torch.testing.assert_close(run_alone(loaded, prompt, steps),
                               run_alone(llms(FAMILY), prompt, steps), rtol=0, atol=0)
    cache = [n for n in loaded.decode_module.state if n.endswith("k_cache")][0]
    assert loaded.prefill_module.state[cache] is loaded.decode_module.state[cache]


def test_the_directory_holds_each_weight_once_and_no_kv_cache(llms, saved):
    model = llms(FAMILY).model
    with safe_open(str(saved / "weights.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    params = {n for n, _ in model.named_parameters()}
    assert params <= keys and not any("cache" in k for k in keys)
    assert keys - params <= {"rope_cos", "rope_sin"}
    weight_bytes = sum(p.nbytes for p in model.parameters())
    assert (saved / "weights.safetensors").stat().st_size < 1.1 * weight_bytes + 65536
    for name in ("llm.json", "modules.json", "config.json", "tokenizer.json",
                 "prefill/manifest.json", "decode/manifest.json"):
        assert (saved / name).is_file(), name
    body = json.loads((saved / "llm.json").read_text())
    assert body["format"] == "kiln-llm" and body["format_version"] == 1
    assert body["max_batch_size"] == 3 and body["config"]["class"] == "LlamaConfig"


def test_paged_llm_round_trip(paged_llm, tmp_path):
    paged_llm.save(tmp_path / "paged.kiln")
    with pytest.MonkeyPatch.context() as mp:
        _no_compiling(mp)
        loaded = kiln.models.load(tmp_path / "paged.kiln")
    assert loaded.paged and loaded.cache_layout == paged_llm.cache_layout
    prompts = [torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([11, 12, 13])]
    steps = torch.tensor([[20, 21, 22], [30, 31, 32]])
    for a, b in zip(run_batched(loaded, prompts, steps), run_batched(paged_llm, prompts, steps)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_loaded_llm_saves_again_with_its_files(loaded, tmp_path):
    loaded.save(tmp_path / "again.kiln")
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "again.kiln" / name).is_file(), name
    again = kiln.models.load(tmp_path / "again.kiln")
    assert again.generate([5, 6, 7], max_new_tokens=5).ids == \
        loaded.generate([5, 6, 7], max_new_tokens=5).ids


# ---- the command line ---------------------------------------------------------------


def test_cli_generate_from_the_saved_llm(saved, loaded, capsys):
    expected = loaded.generate("kiln compiles", max_new_tokens=12, ignore_eos=True)
    for argv in ([str(saved)], ["--model", str(saved)]):
        rc = main(["generate", *argv, "--prompt", "kiln compiles", "--max-new-tokens", "12",
                   "--ignore-eos"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert out == "kiln compiles" + expected.text + "\n"
        assert f"loaded {saved} (compiled for cpu) in" in err
    rc = main(["generate", str(saved), "--prompt", "a", "--prompt", "b", "--prompt", "c",
               "--prompt", "d"])
    err = capsys.readouterr().err
    assert rc == 2 and "batches of up to 3, not 4" in err and "--max-batch-size 4" in err


def test_cli_compile_model_saves_an_llm(checkpoints, llms, tmp_path, capsys, monkeypatch):
    path, _ = checkpoints[FAMILY]
    seen = []
    monkeypatch.setattr(kiln.models, "load",
                        lambda source, **kw: seen.append((source, kw)) or llms(FAMILY))
    out = tmp_path / "cli.kiln"
    rc = main(["compile", "--model", str(path), "-o", str(out), "--max-batch-size", "3",
               "--dtype", "float32", "--max-seq-len", "128"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert seen == [(str(path), dict(dtype="float32", target=None, max_seq_len=128,
                                     max_batch_size=3, paged=False, block_size=16,
                                     random_weights=False, quantize=None))]
    assert f"saved {out}" in stdout and f"kiln generate {out}" in stdout
    assert (out / "llm.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["compile"], "name what to compile"),
    (["compile", "tiny-llama", "--model", "tiny"], "name one thing to compile"),
    (["compile", "--model", "tiny", "--tune", "none"], "--tune is for MODEL"),
    (["compile", "--model", "{saved}"], "is a compiled LLM already"),
    (["generate", "{saved}", "--model", "{saved}", "--prompt", "x"], "name one model"),
])
def test_cli_compile_and_generate_mistakes(argv, message, saved, capsys):
    assert main([a.format(saved=saved) for a in argv]) == 2
    assert message in capsys.readouterr().err


# ---- bad directories and arguments: errors before any weight is read ------------------


@pytest.fixture
def art(saved, tmp_path, monkeypatch):
    """A private copy of the saved LLM to damage; reading a weight fails the test."""
    dst = tmp_path / "bad.kiln"
    shutil.copytree(saved, dst)
    monkeypatch.setattr(weights_mod, "_read", lambda *a: pytest.fail("weights were read"))
    return dst


def _edit(art, **changes):
    body = json.loads((art / "llm.json").read_text())
    body.update(changes)
    (art / "llm.json").write_text(json.dumps(body))


@pytest.mark.parametrize("damage, message", [
    (lambda a: (a / "llm.json").write_text("{"), "cannot read .*llm.json"),
    (lambda a: (a / "llm.json").unlink(), "not a saved kiln LLM: it has no llm.json"),
    (lambda a: _edit(a, format_version=2), "format version 2 .* reads version 1"),
    (lambda a: _edit(a, format="other"), "not a kiln LLM manifest"),
    (lambda a: _edit(a, cache={"kind": "paged"}), "not a valid kiln LLM manifest"),
    (lambda a: _edit(a, config={"class": "GPT2"}), "no model config kiln knows"),
    (lambda a: _edit(a, config={"class": "LlamaConfig", "dim": "x"}), "cannot build"),
    (lambda a: shutil.rmtree(a / "decode"), "lacks module 'decode'"),
    (lambda a: (a / "decode" / "manifest.json").write_text("{"), "decode/manifest.json"),
    (lambda a: (a / "modules.json").write_text("[]"), "modules.json"),
    (lambda a: (a / "tokenizer.json").unlink(), "no tokenizer.json, which llm.json names"),
])
def test_bad_saved_llm(art, damage, message):
    damage(art)
    with pytest.raises(ArtifactError, match=message) as e:
        kiln.models.load(art)
    assert e.value.hint


def test_corrupt_weights_file(saved, tmp_path):
    art = tmp_path / "bad.kiln"
    shutil.copytree(saved, art)
    data = (art / "weights.safetensors").read_bytes()
    (art / "weights.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ArtifactError, match="weights"):
        kiln.models.load(art)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_saved_for_a_gpu_on_a_machine_without_one(art):
    _edit(art, target="cuda:sm_90")
    with pytest.raises(ArtifactError, match="compiled for cuda:sm_90, and this machine has "
                       "no GPU") as e:
        kiln.models.load(art)
    assert "--target cpu" in e.value.hint


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(target="interpret"), ArtifactError, "compiled for cpu, not interpret"),
    (dict(max_seq_len=64), ArgumentError, "context of 128 tokens, not 64"),
    (dict(max_batch_size=4), ArgumentError, "batches of up to 3, not 4"),
    (dict(paged=True), ArgumentError, "contiguous KV cache"),
    (dict(dtype=torch.bfloat16), ArgumentError, "for float32, not bfloat16"),
    (dict(quantize="fp8"), ArgumentError, "quantization is chosen when compiling"),
    (dict(tensor_parallel_size=2), ArgumentError, "single-device"),
])
def test_arguments_a_saved_llm_cannot_honour(art, kwargs, error, message):
    with pytest.raises(error, match=message) as e:
        kiln.models.load(art, **kwargs)
    assert "kiln compile --model" in e.value.hint or "parallelism" in e.value.hint


def test_arguments_it_can_honour(saved):
    llm = kiln.models.load(saved, target="cpu", dtype="float32", max_seq_len=128,
                           max_batch_size=2)
    assert llm.max_batch_size == 3 and llm.model is None


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only: a machine without a GPU")
def test_compile_only_for_a_gpu_and_a_second_compile_tunes_nothing(tmp_path, monkeypatch):
    """Without the GPU an LLM compiles for it (kernels built, not run) and saves; a second
    compile of the same model takes every kernel from KILN_CACHE_DIR, compiling none."""
    import kiln.codegen.autotune.tuner as tuner
    from kiln.models.generate import LLM
    from kiln.models.llama import tiny_llama

    llm = LLM(tiny_llama(n_layers=1, dtype=torch.bfloat16), target="cuda:sm_90")
    assert not llm.runnable and llm.cuda_graphs
    assert list((tmp_path / "kiln-cache" / "autotune" / "choices").iterdir())
    monkeypatch.setattr(tuner, "get_pool", lambda *a: pytest.fail("a kernel was compiled"))
    LLM(tiny_llama(n_layers=1, dtype=torch.bfloat16), target="cuda:sm_90")
    llm.save(tmp_path / "g.kiln")
    assert list((tmp_path / "g.kiln" / "decode" / "kernels").glob("*.cubin"))
    with pytest.raises(ArtifactError, match="compiled for cuda:sm_90, and this machine has "
                       "no GPU"):
        kiln.models.load(tmp_path / "g.kiln")
