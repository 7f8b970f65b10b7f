"""The demo model shipped with npumoe (config, weights, tokenizer, card), and how it was trained (train.py,
corpus.py)."""

from pathlib import Path

DEMO_DIR = Path(__file__).parent
