"""Specification of tools/generate.py: load a run's out-dir, continue a prompt, stop at [EOT].

The out-dir comes from conftest.py (a tiny random model saved with model_pt.save_final, exactly
what the training scripts write); only two tests launch the script itself (~4 s each).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lib import exits
from lib.checkpoints import files
from lib.checkpoints.finished_run import init_from_config, load_model
from lib.checkpoints.model_pt import FINAL_FILES
from lib.extras import sampling
from lib.extras.sampling import generate_ids, generate_text
from tools import generate

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def add(x"


def run_generate(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.generate", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def always_predicts(model, token_id: int):
    """Rewire `model` so that its next token is `token_id` whatever the input.

    The layers add nothing (wo = w2 = 0), every embedding is the same vector of ones, so the final
    norm sees ones everywhere; lm_head scores only `token_id`'s row (ones . ones = hidden_size).
    """
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
        model.tok_embeddings.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id] = 1.0
    return model


def test_cli_prints_the_prompt_and_its_greedy_continuation(out_dir):
    proc = run_generate("--out-dir", str(out_dir), "--prompt", PROMPT, "--max-new-tokens", "12",
                        "--temperature", "0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model, tokenizer = load_model(str(out_dir))
    expected = generate_text(model, tokenizer, PROMPT, 12, temperature=0)
    assert expected.startswith(PROMPT) and len(expected) > len(PROMPT)
    assert proc.stdout == expected + "\n"


def test_cli_reports_a_missing_model_in_one_line_with_exit_code_2(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc = run_generate("--out-dir", str(tmp_path), "--prompt", PROMPT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "model.pt" in proc.stderr and "tokenizer.json" in proc.stderr


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    # A byte that is not UTF-8 (here 0xff) reaches Python as a lone surrogate, which the tokenizer
    # rejected with a traceback.
    proc = run_generate("--out-dir", str(tmp_path), "--prompt", "ab\udcff")
    assert proc.returncode == 2
    assert proc.stderr == "error: --prompt is not valid UTF-8 text (see --help)\n", proc.stderr


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 3)], ids=["greedy", "sampled"])
def test_cached_and_uncached_decoding_give_the_same_text(out_dir, temperature, seed):
    model, tokenizer = load_model(str(out_dir))
    cached = generate_text(model, tokenizer, PROMPT, 30, temperature, seed=seed)
    uncached = generate_text(model, tokenizer, PROMPT, 30, temperature, seed=seed, use_cache=False)
    assert cached == uncached


def test_greedy_decoding_is_deterministic(out_dir):
    model, tokenizer = load_model(str(out_dir))
    texts = {generate_text(model, tokenizer, PROMPT, 30, temperature=0, seed=s) for s in range(3)}
    assert len(texts) == 1  # the seed plays no part at temperature 0


def test_the_same_seed_gives_the_same_sample_and_other_seeds_others(out_dir):
    model, tokenizer = load_model(str(out_dir))
    samples = [generate_text(model, tokenizer, PROMPT, 30, 1.0, top_k=None, seed=s)
               for s in (0, 0, 1, 2)]  # fmt: skip
    assert samples[0] == samples[1]
    assert len(set(samples[1:])) == 3


def test_the_prompt_is_prefixed_with_bot(out_dir, monkeypatch):
    model, tokenizer = load_model(str(out_dir))
    seen = []
    monkeypatch.setattr(sampling, "generate", lambda model, ids, *a, **k: seen.append(ids) or ids)
    generate_text(model, tokenizer, PROMPT, 5)
    assert seen[0][0].tolist() == [tokenizer.bot_id, *tokenizer.encode(PROMPT)]


def test_decoding_stops_at_eot(out_dir):
    model, tokenizer = load_model(str(out_dir))
    eot = tokenizer.token_to_id("[EOT]")
    assert generate_text(always_predicts(model, eot), tokenizer, PROMPT, 20, 0) == PROMPT
    # The control: the same rewiring toward an ordinary token keeps going to max_new_tokens.
    a = tokenizer.token_to_id("a")
    assert generate_text(always_predicts(model, a), tokenizer, PROMPT, 20, 0) == PROMPT + "a" * 20


def test_a_long_request_stops_at_the_end_of_the_context(out_dir):
    model, tokenizer = load_model(str(out_dir))
    a = tokenizer.token_to_id("a")
    text = generate_text(always_predicts(model, a), tokenizer, PROMPT, 1000, 0)
    prompt_tokens = 1 + len(tokenizer.encode(PROMPT))  # [BOT] + prompt
    assert text == PROMPT + "a" * (model.config.max_position_embeddings - prompt_tokens)


def test_a_prompt_as_long_as_the_context_is_refused(out_dir):
    model, tokenizer = load_model(str(out_dir))
    with pytest.raises(ValueError, match="context"):
        generate_text(model, tokenizer, "x = 1\n" * 100, 5)


def test_bf16_weights_generate_with_a_bf16_cache(out_dir):
    # What a GPU run does (bf16 where supported); on CPU only when asked for.
    model, tokenizer = load_model(str(out_dir), "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    text = generate_text(model, tokenizer, PROMPT, 10, temperature=0)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


def test_load_model_refuses_what_is_not_an_out_dir(out_dir, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_model(str(tmp_path / "nowhere"))
    for name in ("model.pt", "config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((out_dir / name).read_bytes())
    (tmp_path / "config.json").write_text('{"hidden_sise": 32}')
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_bytes((out_dir / "config.json").read_bytes())
    (tmp_path / "model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="model.pt"):
        load_model(str(tmp_path))


def reseal(out: Path) -> None:
    """final.sums for out's files as they are now: the checksums their run would have written."""
    names = [n for n in FINAL_FILES if (out / n).exists()]
    files.write_sums_of(str(out), names)


def copy_out_dir(source: Path, out: Path) -> Path:
    """A copy of a run's final files (model.pt, config.json, tokenizer.json) to spoil."""
    out.mkdir()
    for name in ("model.pt", "config.json", "tokenizer.json"):
        (out / name).write_bytes((source / name).read_bytes())
    return out


@pytest.mark.parametrize(
    "name, content, expect",
    [("model.pt", [1, 2], "model.pt does not fit {out}/config.json (it is not a state_dict)"),
     ("model.pt", b"\x80\x02\x53" + bytes(range(256)), "could not read {out}/model.pt as a model "
                                                      "state_dict (not a file torch.save wrote, or "
                                                      "a damaged one)"),
     ("model.pt", {"model": {}, "optimizer": {}, "step": 4}, "model.pt is a training checkpoint, "
                                                           "not the model.pt a run writes"),
     ("model.pt", {"tok_embeddings.weight": torch.zeros(2)}, "model.pt does not fit "
                                                           "{out}/config.json (missing layers.0."),
     ("config.json", {"vocab_size": 1e30, "num_hidden_layers": "4"}, "bad values: vocab_size "
                     "1e+30, num_hidden_layers '4' (sizes are integers from 1 to 2**31 - 1)"),
     ("config.json", {"hidden_size": 2**40}, "bad values: hidden_size 1099511627776")],
    ids=["a_list", "pickle_bytes", "training_checkpoint", "other_keys", "sizes", "huge"],
)  # fmt: skip
def test_a_model_pt_or_config_json_that_is_not_one_is_refused_in_one_line(
    out_dir, tmp_path, name, content, expect
):
    # Before: a TypeError, OverflowError or multi-line torch message (advising weights_only=False
    # for a damaged file) as a traceback, or a wall of "Missing key(s)" lines.
    out = copy_out_dir(out_dir, tmp_path / "out")
    if name == "config.json":
        config = {**json.loads((out / name).read_text()), **content}
        (out / name).write_text(json.dumps(config))
    elif isinstance(content, bytes):
        (out / name).write_bytes(content)
    else:
        torch.save(content, out / name)
    with pytest.raises(ValueError) as refusal:  # (tools/generate.py: one line, exit 2; see above)
        load_model(str(out))
    assert expect.format(out=out) in str(refusal.value), str(refusal.value)
    assert "\n" not in str(refusal.value), str(refusal.value)


def test_the_training_scripts_sample_is_generate_text_with_seed_0(out_dir):
    model, tokenizer = load_model(str(out_dir))
    expected = generate_text(model, tokenizer, "def ", 20, seed=0)
    assert sampling.sample_text(model, tokenizer, "def ", 20) == expected


def test_the_sample_of_a_compiled_run_is_generated_eagerly(out_dir):
    # --compile compiles each layer; generating through them would compile them again for the
    # prompt's and one token's shapes (seconds on a CPU, at the end of a run). A backend that
    # refuses to compile shows that nothing is.
    def refuse(graph_module, example_inputs):
        raise AssertionError("the sample compiled a layer")

    model, tokenizer = load_model(str(out_dir))
    expected = generate_text(model, tokenizer, "def ", 20, seed=0)
    for layer in model.layers:
        layer.compile(backend=refuse)
    assert sampling.sample_text(model, tokenizer, "def ", 20) == expected


# -------------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, no traceback


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """tools/generate.py's main() with argv, as `python -m tools.generate` runs it (exits.run):
    (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["tools/generate.py", *argv])
    code = 0
    try:
        exits.run(generate.main)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_refuses_a_nan_temperature_in_one_line(out_dir):
    proc = run_generate("--out-dir", str(out_dir), "--temperature", "nan")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "error: argument --temperature: expected a number >= 0, got 'nan' (see --help)\n"
    )


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--temperature", "inf", "expected a number >= 0"),
        ("--temperature", "-0.5", "expected a number >= 0"),
        ("--top-p", "nan", "expected a number in (0, 1]"),
        ("--top-p", "0", "expected a number in (0, 1]"),
        ("--top-p", "1.5", "expected a number in (0, 1]"),
        ("--top-k", "-1", "expected an integer >= 0"),  # 0: off
        ("--top-k", "2.5", "expected an integer >= 0"),
        ("--max-new-tokens", "0", "expected an integer >= 1"),
        ("--max-new-tokens", "1e9", "expected an integer >= 1"),
        ("--seed", "-1", "expected an integer in [0, 18446744073709551615]"),
        ("--seed", str(2**64), "expected an integer in [0, 18446744073709551615]"),
        ("--device", "banana", "'banana' is not a device"),
        ("--device", "meta", "meta tensors hold no values"),
    ],
)
def test_cli_refuses_out_of_range_numbers_and_unknown_devices(
    out_dir, monkeypatch, capsys, flag, value, expected
):
    code, out, err = run_main(monkeypatch, capsys, "--out-dir", str(out_dir), flag, value)
    assert code == 2 and out == ""
    assert err.startswith(f"error: argument {flag}: {expected}") and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a CUDA GPU")
def test_cli_refuses_cuda_without_a_gpu_in_one_line(out_dir, monkeypatch, capsys):
    for device in ("cuda", "cuda:1"):
        argv = ["--out-dir", str(out_dir), "--device", device]
        code, out, err = run_main(monkeypatch, capsys, *argv)
        assert code == 2 and out == ""
        assert err.startswith(f"error: argument --device: {device}: no CUDA GPU here"), err
        assert "use --device cpu" in err and err.count("\n") == 1, err


def test_cli_says_once_when_the_context_ends_the_continuation(out_dir, monkeypatch, capsys):
    context = load_model(str(out_dir))[0].config.max_position_embeddings
    argv = ["--out-dir", str(out_dir), "--prompt", PROMPT, "--temperature", "0"]
    code, out, err = run_main(monkeypatch, capsys, *argv, "--max-new-tokens", "100000000")
    assert code == 0 and out.startswith(PROMPT)
    assert err.count("\n") == 1, err
    assert err.startswith(f"note: stopped at the model's context of {context} tokens"), err
    # Within the context: no note.
    code, out, err = run_main(monkeypatch, capsys, *argv, "--max-new-tokens", "3")
    assert code == 0 and out.startswith(PROMPT) and err == ""


def test_generate_ids_says_whether_the_context_cut_the_continuation(out_dir):
    model, tokenizer = load_model(str(out_dir))
    room = model.config.max_position_embeddings - 1 - len(tokenizer.encode(PROMPT))
    to_a = always_predicts(model, tokenizer.token_to_id("a"))
    assert generate_ids(to_a, tokenizer, PROMPT, room + 1, 0)[1] is True
    assert generate_ids(to_a, tokenizer, PROMPT, room, 0)[1] is False  # exactly what was asked
    # An end of document before the context ends is no cut, whatever was asked.
    to_eot = always_predicts(model, tokenizer.eot_id)
    assert generate_ids(to_eot, tokenizer, PROMPT, 10**8, 0)[1] is False


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_cli_refuses_a_model_with_nan_weights_in_one_line(
    out_dir, tmp_path, monkeypatch, capsys, temperature
):
    # Before: sampling failed in torch.multinomial with a traceback, and greedy printed nothing.
    out = copy_out_dir(out_dir, tmp_path / "out")
    weights = torch.load(out / "model.pt", weights_only=True)
    weights["norm.weight"] = torch.full_like(weights["norm.weight"], float("nan"))
    torch.save(weights, out / "model.pt")
    reseal(out)  # (as a run whose weights went NaN wrote them)
    code, stdout, stderr = run_main(monkeypatch, capsys, "--out-dir", str(out), "--temperature",
                                    temperature, "--device", "cpu")  # fmt: skip
    assert code == 2 and stdout == "", stdout
    assert stderr == (f"error: {out}/model.pt holds NaN or infinite weights: nothing to generate "
                      f"from (an earlier checkpoint may hold finite ones)\n")  # fmt: skip


def test_a_replaced_tokenizer_is_refused_by_generate_export_and_init_from(out_dir, tmp_path):
    # config.json records the sha256 of the tokenizer the model was trained with: another
    # tokenizer.json of the same size (two tokens' ids swapped) would decode every id into the
    # wrong text without an error. Each reader refuses it in one line, and writes nothing.
    copy = tmp_path / "out"
    copy.mkdir()
    for name in ("model.pt", "config.json", "tokenizer.json", "tokenizer_config.json"):
        if (out_dir / name).exists():
            (copy / name).write_bytes((out_dir / name).read_bytes())
    spec = json.loads((copy / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    # (copied without final.sums, as from a run older than them: the fingerprint still holds)
    said = f"{copy}/tokenizer.json is not the tokenizer this model was trained with"
    proc = run_generate("--out-dir", str(copy), "--prompt", PROMPT)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"warning: {copy} has no final.sums"), proc.stderr
    assert proc.stderr.count("\n") == 2, proc.stderr
    hf = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "tools.export_hf", str(copy), str(hf)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not hf.exists()
    proc = subprocess.run([sys.executable, "train_dp.py", "--init-from", str(copy), "--out-dir",
                           str(tmp_path / "run"), "--max-steps", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["model.pt", "config.json", "tokenizer_config.json"])
def test_a_final_file_changed_since_its_run_wrote_it_is_refused_naming_it(out_dir, tmp_path, name):
    # A flipped byte in model.pt, an edited rope_theta: once used silently by generate, export_hf
    # and --init-from (only tokenizer.json was checked, by its fingerprint).
    out = tmp_path / "out"
    shutil.copytree(out_dir, out)
    path = out / name
    if name == "config.json":
        path.write_text(path.read_text().replace('"rope_theta": 500000.0', '"rope_theta": 5.0'))
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{path} is damaged") as refusal:
        load_model(str(out))
    assert "\n" not in str(refusal.value)
    with pytest.raises(ValueError, match=f"{path} is damaged"):
        init_from_config(str(out))


def test_an_out_dir_without_checksums_is_used_with_a_one_line_warning(out_dir, tmp_path, capsys):
    out = copy_out_dir(out_dir, tmp_path / "out")  # (no final.sums: a run older than them)
    load_model(str(out))
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {out} has no final.sums") and err.count("\n") == 1, err


def test_an_out_dir_copied_without_one_of_its_final_files_names_the_missing_one(out_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(out_dir, out)
    (out / "tokenizer_config.json").unlink()  # (once: "... is damaged: its bytes are not ...")
    with pytest.raises(ValueError, match=f"{out} has no tokenizer_config.json, which final.sums"):
        load_model(str(out))
