"""A tokenizer.json made elsewhere (--tokenizer, the one in --init-from, or the out-dir of a
finished run for tools/generate.py and tools/export_hf.py): any Hugging Face tokenizer, and the
three tokens the pipeline needs, found in it. data.load_tokenizer imports this only for such a
file; a tokenizer that a run trains has its own.

    tokenizer, roles = read_tokenizer("tokenizer.json", {"eot": "</s>"}, data.HF_NAMES)
"""

import json
import os

from tokenizers import Tokenizer

# How the three tokens are found when neither the flags (--bot-token, ...) nor a
# tokenizer_config.json beside the file name them: the first of these the vocabulary has (this
# suite's; Llama 3, Llama 2/Mistral, Gemma, GPT-2/Qwen). No padding token: pad mode pads with the
# end token (the loss ignores padded targets).
CONVENTIONS = {
    "bot": ("[BOT]", "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"),
    "eot": ("[EOT]", "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"),
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<|finetune_right_pad_id|>", "<|padding|>"),
}


def read_tokenizer(path: str, specials: dict | None, hf_names: dict) -> tuple[Tokenizer, dict]:
    """A tokenizer.json (this suite's, or any Hugging Face one) and its special tokens: {"bot":
    token, "eot": ..., "pad": ...}; ValueError saying why if it cannot be used.

    Each of the three is, in this order: the one `specials` names (--bot-token, ...), the one a
    tokenizer_config.json beside the file names (by its Hugging Face name, hf_names[role]:
    bos_token, ...; every run's out-dir holds one), or the first of CONVENTIONS in the
    vocabulary. Padding falls back to the end token.
    """
    if os.path.isdir(path):
        raise ValueError(f"tokenizer file {path!r} is a folder: name the tokenizer.json in it")
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path!r} does not exist")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for unparsable files
        raise ValueError(
            f"could not read {path!r} as a tokenizers tokenizer.json ({e}); pass a file saved "
            f"by Tokenizer.save() or save_pretrained() (every run writes one to its out-dir), "
            f"or leave out --tokenizer to train one"
        ) from e
    config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    beside = _tokenizer_config(config_path, hf_names)
    found = {}
    for role in ("bot", "eot", "pad"):
        flag = f"--{role}-token"
        named = (specials or {}).get(role)
        if named is not None and tokenizer.token_to_id(named) is None:
            raise ValueError(f"{flag} {named!r} is not a token of {path}")
        if named is None and tokenizer.token_to_id(beside.get(hf_names[role]) or "") is not None:
            named = beside[hf_names[role]]
        if named is None:
            known = (t for t in CONVENTIONS[role] if tokenizer.token_to_id(t) is not None)
            named = next(known, None)
        if named is None and role == "pad":
            named = found["eot"]
        if named is None:
            what = "beginning" if role == "bot" else "end"
            raise ValueError(
                f"{path} has none of the usual {what}-of-document tokens "
                f"({', '.join(CONVENTIONS[role])}): name one with {flag}"
            )
        found[role] = named
    return tokenizer, found


def _tokenizer_config(path: str, hf_names: dict) -> dict[str, str]:
    """The special tokens a Hugging Face tokenizer_config.json names ({} if there is none): each
    a string, or an object whose "content" is the string; null where it names none."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    names = {}
    for key in hf_names.values():
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            names[key] = value
    return names
