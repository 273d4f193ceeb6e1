"""Fill-in-the-middle prompts, in the convention the tokenizer's vocabulary reveals (stdlib only).

    StarCoder       <fim_prefix> <fim_suffix> <fim_middle>       repo: <repo_name> <file_sep>
    Qwen2.5-Coder   <|fim_prefix|> <|fim_suffix|> <|fim_middle|> repo: <|repo_name|> <|file_sep|>
    CodeLlama       ▁<PRE> ▁<SUF> ▁<MID> (end ▁<EOT>)           (GGUF vocabularies may drop the ▁)
    DeepSeek-Coder  <｜fim▁begin｜> <｜fim▁hole｜> <｜fim▁end｜>

The prompt is prefix-suffix-middle, laid out as llama.cpp's /infill does (so IDE
plugins written against it see the same model input):

    [BOS] [<repo>myproject\\n (<sep>{filename}\\n{text})* <sep>filename\\n] <pre>{prefix}<suf>{suffix}<mid>{middle}

Without repo/file-separator tokens the extra files' text simply comes first.
"""

from __future__ import annotations

from dataclasses import dataclass

CONVENTIONS = [  # name, prefix, suffix, middle, repo, file separator, end of infill
    ("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>", None),
    ("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>", None),
    ("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", None, None, "▁<EOT>"),
    ("codellama", "<PRE>", "<SUF>", "<MID>", None, None, "<EOT>"),
    ("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, None),
]


@dataclass(frozen=True)
class FimTokens:
    name: str
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None
    end: int | None = None  # a token that ends the infill, besides EOS

    @classmethod
    def detect(cls, token_to_id) -> FimTokens | None:
        """The first convention whose prefix, suffix and middle tokens the vocabulary has."""
        for name, pre, suf, mid, repo, sep, end in CONVENTIONS:
            ids = [token_to_id(t) for t in (pre, suf, mid)]
            if all(i is not None for i in ids):
                opt = [token_to_id(t) if t else None for t in (repo, sep, end)]
                return cls(name, *ids, *opt)
        return None

    def encode(self, tokenizer, prefix: str, suffix: str, extra: list[tuple[str, str]] = (),
               middle: str = "") -> list[int]:
        def enc(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

        ids = list(tokenizer.encode("", add_special_tokens=True))  # BOS where the model wants one
        if self.repo is not None and self.file_sep is not None:
            ids += [self.repo] + enc("myproject\n")
            for filename, text in extra:
                ids += [self.file_sep] + enc(f"{filename}\n{text}")
            ids += [self.file_sep] + enc("filename\n")
        else:
            for _, text in extra:
                ids += enc(text)
        return ids + [self.prefix] + enc(prefix) + [self.suffix] + enc(suffix) + [self.middle] + enc(middle)
