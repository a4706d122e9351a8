"""Raw text packed into fixed-length chunks: documents tokenized and concatenated into one token stream
(each followed by EOS; no padding anywhere), cut into chunks of ``chunk_length`` tokens, and each
chunk turned into one example by the objective's ``make_example`` (span corruption: a mask drawn from
(seed, epoch, rank, chunk position)).

``PackedStream`` wraps this process's ``ExampleStream`` of documents and behaves like it for the
trainer (epochs, its share, bad rows, ``state_dict``). Its state adds what the packer holds between
two chunks: the tokens not in a chunk yet (fewer than one chunk) and the text of the document being
tokenized (a long document is tokenized ``SLICE_CHARS`` at a time, never held as tokens whole), so a
resumed run cuts exactly the chunks the stopped one would have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from data.sources.corpus import Example

SLICE_CHARS = 16_384  # a document's text is tokenized this much at a time (cut at whitespace where there is some)


def slice_end(text: str, start: int, size: int = SLICE_CHARS) -> int:
    """Where the slice of ``text`` beginning at ``start`` ends: at most ``size`` characters on, just after
    the last whitespace before that when there is some (so words are not split), else at the end."""
    if len(text) - start <= size:
        return len(text)
    cut = max(text.rfind(" ", start, start + size), text.rfind("\n", start, start + size)) + 1
    return cut if cut > start else start + size


def text_slices(text: str, size: int = SLICE_CHARS) -> Iterator[str]:
    """``text`` in the consecutive slices ``slice_end`` cuts, whose concatenation is ``text``."""
    start = 0
    while start < len(text):
        end = slice_end(text, start, size)
        yield text[start:end]
        start = end


class PackedStream:
    """Chunks of ``chunk_length`` tokens from a stream of documents (see the module's docstring).

    Args:
        documents: this process's ``ExampleStream`` of raw-text rows (``prompt`` holds the text).
        tokenizer: the run's tokenizer (no special tokens added: EOS is appended per document here).
        chunk_length: tokens per chunk.
        make_example: (chunk token ids, epoch, position in the epoch, the (file index, row) of each document
            the chunk holds tokens of, in order) -> Example.
    """

    def __init__(self, documents, tokenizer, chunk_length: int, make_example: Callable[..., Example]):
        self.documents = documents
        self.tokenizer = tokenizer
        self.chunk_length = chunk_length
        self.make_example = make_example
        self.carry: list[int] = []  # tokens read but not in a chunk yet (fewer than chunk_length)
        self.pending = ""  # the text of the current document ("" once it is all tokenized)
        self.pending_at = 0  # how much of it is tokenized (an offset: re-slicing the rest would be quadratic)
        self.pending_source: tuple[int, int] = (0, 0)  # its (file index, row)
        # [file index, row, where its tokens start in carry] of each document with tokens in carry
        self.carry_sources: list[list[int]] = []
        self.position = 0  # chunks made by this process in epoch ``position_epoch``
        self.position_epoch = 0

    # the trainer's view of a stream: delegated to the documents
    @property
    def epoch(self) -> int:
        return self.documents.epoch

    @property
    def problems(self):
        return self.documents.problems

    @property
    def total_rows(self) -> int:
        return self.documents.total_rows

    @property
    def rows_read(self) -> int:
        return self.documents.rows_read

    def share(self, file_index: int) -> tuple[int, int]:
        return self.documents.share(file_index)

    def close_epoch(self, epoch: int) -> None:
        self.documents.close_epoch(epoch)

    def finished_epoch(self, epoch: int) -> bool:
        """No document left in the epoch and too few tokens held for another chunk."""
        return self.documents.finished_epoch(epoch) and not self._chunk_ready()

    def _chunk_ready(self) -> bool:
        return len(self.carry) >= self.chunk_length or bool(self.pending)

    def iter_epoch(self) -> Iterator[Example]:
        """This epoch's chunks; the tokens left at its end (fewer than a chunk) start the next epoch's first."""
        epoch = self.documents.epoch
        if epoch != self.position_epoch:
            self.position, self.position_epoch = 0, epoch
        yield from self._drain(epoch)
        for document in self.documents.iter_epoch():
            self.pending, self.pending_at = document.prompt, 0
            self.pending_source = (document.file_index, document.row)
            yield from self._drain(epoch)

    def _drain(self, epoch: int) -> Iterator[Example]:
        """Chunks from the held tokens and the pending text, until fewer than a chunk is left."""
        while True:
            while len(self.carry) >= self.chunk_length:
                chunk = self.carry[:self.chunk_length]
                del self.carry[:self.chunk_length]
                example = self.make_example(chunk, epoch, self.position, self._take_sources())
                self.position += 1
                yield example
            if not self.pending:
                return
            end = slice_end(self.pending, self.pending_at)
            piece, self.pending_at = self.pending[self.pending_at:end], end
            if not self.carry_sources or self.carry_sources[-1][:2] != list(self.pending_source):
                self.carry_sources.append([*self.pending_source, len(self.carry)])
            self.carry.extend(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
            if end == len(self.pending):
                self.carry.append(self.tokenizer.eos_token_id)  # the document ends here
                self.pending, self.pending_at = "", 0

    def _take_sources(self) -> list[tuple[int, int]]:
        """The documents of the chunk just cut from carry; those with tokens left stay, their starts moved."""
        cut = self.chunk_length
        taken = [(f, row) for f, row, start in self.carry_sources if start < cut]
        ends = [start for _, _, start in self.carry_sources[1:]] + [cut + len(self.carry)]
        self.carry_sources = [[f, row, max(start - cut, 0)]
                              for (f, row, start), end in zip(self.carry_sources, ends) if end > cut]
        return taken

    def state_dict(self) -> dict:
        return {"documents": self.documents.state_dict(), "carry": list(self.carry),
                "pending": self.pending[self.pending_at:],  # only the text not tokenized yet
                "carry_sources": [list(s) for s in self.carry_sources],
                "pending_source": list(self.pending_source), "position": self.position,
                "position_epoch": self.position_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.documents.load_state_dict(state["documents"])
        self.carry, self.pending, self.pending_at = list(state["carry"]), state["pending"], 0
        self.pending_source, self.position = tuple(state["pending_source"]), state["position"]
        self.position_epoch = state["position_epoch"]
        self.carry_sources = [list(s) for s in state.get("carry_sources", [])]
