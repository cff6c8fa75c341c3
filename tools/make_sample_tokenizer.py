"""Train the small SentencePiece model bundled with the examples, reproducibly, from bundled text.

    python tools/make_sample_tokenizer.py            # examples/data/corpus.txt -> examples/data/tokenizer.model

256 pieces: the vocabulary of the ``qwen3-tiny`` card, so every id fits the model. BPE over single
digits (arithmetic stays digit by digit), identity normalisation (no normaliser tables: the file
stays a few KB), one thread and no sentence sampling or shuffling, so the same corpus and the same
SentencePiece version give the same pieces. Ids: 0 <unk>, 1 <s>, 2 </s>.
"""
from __future__ import annotations

import argparse
import io
from pathlib import Path

import sentencepiece as spm

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
VOCAB_SIZE = 256


def train(corpus: Path, model_path: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Train on ``corpus`` (one sentence per line) and write the model to ``model_path``."""
    model = io.BytesIO()
    # Sentences from an iterator and the model to a buffer: the model then records no file paths,
    # so it is byte-for-byte the same wherever it is trained.
    with corpus.open(encoding="utf-8") as lines:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(line.rstrip("\n") for line in lines),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=1.0,
            split_digits=True,
            normalization_rule_name="identity",
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    model_path.write_bytes(model.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DATA / "corpus.txt")
    parser.add_argument("--out", type=Path, default=DATA / "tokenizer.model")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    if not args.corpus.is_file():
        raise SystemExit(f"corpus not found: {args.corpus}")
    train(args.corpus, args.out, args.vocab_size)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {args.vocab_size} pieces)")


if __name__ == "__main__":
    main()
