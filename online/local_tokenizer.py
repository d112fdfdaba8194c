"""A small byte-level BPE tokenizer built here, with nothing downloaded, for a load generator
that needs a Hugging Face tokenizer to write its prompts (aiperf). Run by the load
generator's own Python (it needs ``tokenizers`` and ``transformers``, which aiperf brings):

    python online/local_tokenizer.py HF_HOME REPO_ID

lays it out as a Hugging Face cache entry ``REPO_ID`` under ``HF_HOME``, which loads with
``HF_HUB_OFFLINE=1`` (aiperf refuses a plain folder there). Byte-level: any text encodes and
decodes back exactly. Trained on sentences drawn from a fixed word list with a fixed seed, so
the same tokenizer comes out every time.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

WORDS = ("the of and to in is was for on that with as by at from it this be are or an which "
         "have has not but they one all were we can their more time there been system model "
         "token request server latency stream batch queue prompt output people year way day "
         "thing life world school state family group country problem hand part place case "
         "week company number").split()
SNAPSHOT = "0" * 40


def build(hf_home: Path, repo_id: str) -> Path:
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))).capitalize() + "."
              for _ in range(5000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                 bos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                 pad_token="<|endoftext|>", model_max_length=1_000_000)
    root = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    hf.save_pretrained(root / "snapshots" / SNAPSHOT)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    return root / "snapshots" / SNAPSHOT


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), sys.argv[2]))
