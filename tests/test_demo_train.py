"""The demo model's training script still runs, and the shipped model matches its card.

CI never retrains: the smoke run takes a few steps on a handful of files into a tmp dir.
"""

import json

import pytest

from npumoe.models.loader import DEMO_DIR

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from npumoe.models.demo import train

    out = tmp_path_factory.mktemp("demo_smoke")
    threads = torch.get_num_threads()
    try:
        card = train.main(["--steps", "6", "--max-files", "5", "--batch", "4", "--seq", "128", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # main() pins 2 threads, as the shipped run did
    return out, card


def test_smoke_training_lowers_loss(smoke):
    out, card = smoke
    assert card["final_train_loss"] < card["first_train_loss"]
    assert card["first_train_loss"] == pytest.approx(5.545, abs=0.3)  # ≈ ln 256 at init
    assert card["corpus"]["train_files"] == 5 and card["corpus"]["heldout_files"] == 5
    assert len(card["imbalance_r_chunk64"]) == card["layers"]
    assert json.loads((out / "card.json").read_text()) == card
    assert (out / "CARD.md").is_file()
    assert not (out / "generation_config.json").exists()


def test_smoke_checkpoint_reloads_with_transformers(smoke):
    out, _ = smoke
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    prompt = list(b"def f(x):\n    return x")
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), 256)
    assert torch.isfinite(logits).all()


def test_smoke_checkpoint_loads_in_npumoe(smoke):
    import npumoe

    model = npumoe.load(smoke[0])
    assert model.tokenizer.encode("def ") == list(b"def ")
    assert model.spec.num_layers == 4


def test_shipped_model_matches_its_card():
    for name in ("config.json", "model.safetensors", "card.json", "CARD.md"):
        assert (DEMO_DIR / name).is_file(), f"models/demo/{name} is missing"
    config = json.loads((DEMO_DIR / "config.json").read_text())
    card = json.loads((DEMO_DIR / "card.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert card["layers"] == config["num_hidden_layers"] == 4
    experts = config.get("num_experts", config.get("num_local_experts"))
    assert card["experts"] == experts == 8
    assert card["top_k"] == config["num_experts_per_tok"] == 2
    assert config["vocab_size"] == 256 and config["tie_word_embeddings"] is True
    assert len(card["imbalance_r_chunk64"]) == card["layers"]
    assert card["corpus"]["max_files"] is None  # the shipped model saw the whole corpus
    assert 0 < card["heldout_bits_per_byte"] < 8
    assert (DEMO_DIR / "model.safetensors").stat().st_size < 20_000_000


def test_shipped_corpus_split_is_disjoint():
    from npumoe.models.demo import corpus

    train, held = corpus.split(max_files=10)
    assert train and held and not set(train) & set(held)
    assert all(corpus.is_held_out(k.split("/", 1)[1]) for k in held)
