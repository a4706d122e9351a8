"""``--objective=span_corruption``: T5's pretraining objective on raw text (the maths: ``span_noise``)."""

from __future__ import annotations

from config import TrainConfig
from data.objectives import span_noise
from data.objectives.packed_text import PackedTextObjective
from lowmem.utils.errors import UserError


class SpanCorruptionObjective(PackedTextObjective):
    """T5's pretraining objective: chunks of the raw length that corrupts to exactly ``--max_source_len``
    input tokens; in each chunk ``--noise_density`` of the tokens, in spans of ``--mean_noise_span_length``
    on average, are replaced by sentinels in the inputs and make up the targets (``data.objectives.span_noise``)."""

    name = "span_corruption"
    summary = ("T5's pretraining on raw text in --text_column, .txt files too: documents packed into chunks, "
               "spans of tokens replaced by sentinels")
    unused_flags = ()
    trained_with = (*PackedTextObjective.trained_with, "noise_density", "mean_noise_span_length")

    @classmethod
    def problems(cls, cfg: TrainConfig) -> list[str]:
        problems = []
        if not 0 < cfg.noise_density < 1:
            problems.append(f"--noise_density must be in (0, 1) (got {cfg.noise_density})")
        if cfg.mean_noise_span_length < 1:
            problems.append(f"--mean_noise_span_length must be at least 1 (got {cfg.mean_noise_span_length})")
        return problems + super().problems(cfg)

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.noise = (cfg.noise_density, cfg.mean_noise_span_length)
        if cfg.max_source_len < 3:
            raise UserError("--objective=span_corruption needs --max_source_len of at least 3 (a kept token, a "
                            f"sentinel and the end of the sequence; got {cfg.max_source_len}): T5 uses 512")
        self.chunk_length, self.targets_length = span_noise.corrupted_lengths(cfg.max_source_len, *self.noise)
        self.fixed_lengths = (cfg.max_source_len, self.targets_length)
        noise_tokens, spans = span_noise.span_counts(self.chunk_length, *self.noise)
        if spans > self.chunk_length - noise_tokens:  # the kept tokens separate the spans: one run between two
            kept = self.chunk_length - noise_tokens
            raise UserError(f"--noise_density={cfg.noise_density} with --mean_noise_span_length="
                            f"{cfg.mean_noise_span_length} drops {noise_tokens} of a chunk's {self.chunk_length} "
                            f"tokens in {spans} spans, more than the {kept} tokens kept to separate them: lower "
                            "--noise_density or raise --mean_noise_span_length (T5: 0.15 and 3)")
        if self.targets_length > cfg.max_target_len:
            raise UserError(f"--objective=span_corruption with --max_source_len={cfg.max_source_len} makes targets of "
                            f"{self.targets_length} tokens: set --max_target_len={self.targets_length} (it is "
                            f"{cfg.max_target_len})")

    def shape(self) -> str:
        return (f"{self.max_source_len} input / {self.targets_length} target tokens after span_corruption, "
                "no padding")

    def transform(self, tokenizer):
        spans = span_noise.span_counts(self.chunk_length, *self.noise)[1]  # sentinels a chunk needs
        has = span_noise.sentinels_in(tokenizer, spans)
        if 0 < has < spans:
            longest = span_noise.longest_source_for(has, *self.noise)
            names = ("the top byte ids no UTF-8 text holds, counting down as ByT5 was pretrained; its recipe: "
                     "--mean_noise_span_length=20" if span_noise.is_byt5(tokenizer)
                     else f"<extra_id_0>..<extra_id_{has - 1}>")
            raise UserError(f"a chunk of --max_source_len={self.max_source_len} tokens gets {spans} noise spans, each "
                            f"named by a sentinel, and the tokenizer has {has} ({names}): "
                            f"set --max_source_len={longest} or less, or raise --mean_noise_span_length")
        sentinels, eos = span_noise.sentinel_ids(tokenizer, spans), tokenizer.eos_token_id

        def corrupt(chunk: list[int], rng) -> tuple[list[int], list[int]]:
            mask = span_noise.noise_mask(len(chunk), rng, *self.noise)
            return span_noise.corrupt(chunk, mask, sentinels, eos)

        return corrupt
