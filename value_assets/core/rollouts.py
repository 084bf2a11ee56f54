"""Text rollouts from any RL stack -> Miles-format datasets and a manifest (docs/rules.md#dataset).

`value-assets import-rollouts` reads JSONL or Parquet records holding a prompt (text, or chat
messages), a response text and a scalar reward, tokenizes them with the actor's tokenizer, and
writes `train.jsonl`, `heldout.jsonl` and a `miles.value-pretrain.v1` manifest whose provenance
records what went in (input shas, tokenizer sha, field names, split rule).

Decisions:
- The reward is broadcast to every response token (the Monte-Carlo return with gamma = lambda = 1,
  what an SAO critic is trained on). No loss mask: every response token is a target.
- The held-out split is by prompt group: every sample of one prompt lands in the same split, so the
  held-out EV measures generalisation to unseen prompts, not memorised ones. Groups are ordered by
  sha256(seed, group key), and the first round(fraction x groups) go to held-out (at least one
  group each side). The assignment depends on the seed and the group keys only, never on file
  order. The group key is the rendered prompt text unless a group field is named.
- Default sample ids are `FILE-STEM:LINE` (`:rN` for Parquet rows); when two inputs share a stem,
  their paths relative to the inputs' common folder (without the suffix) replace the stems.
- Chat roles must be ones a chat template knows (`CHAT_ROLES`): a template renders an unknown or
  empty role silently (as a role the actor never saw, or not at all). A template that refuses a
  prompt (its own `raise_exception`, a syntax error) is refused at the record's `file:line`.
- Nothing is written unless every record is valid: every row is checked by the dataset rules
  (`rows.check_row`, what `train` applies) at its input's `file:line` before anything is staged;
  the output folder is built beside the target and renamed into place at the end, and any error
  while writing it (ENOSPC, EACCES) removes it again and names the path (`paths.staged_folder`).

The tokenizer is passed in (anything with the `Tokenizer` protocol), so this module stays
torch-free; the command line builds a Hugging Face one (value_assets/gpu/convert/tokenizer.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from value_assets.core.errors import InputError, show
from value_assets.core.hashing import sha256_bytes, sha256_file
from value_assets.core.manifest import SCHEMA
from value_assets.core.objective import MAX_ABS_VALUE, Objective
from value_assets.core.paths import confined, plain_name, staged_file, staged_folder
from value_assets.core.publish import write_new
from value_assets.core.rows import check_row
from value_assets.core.strict_json import canonical_bytes, is_number, loads

IMPORTER = "value-assets import-rollouts"


@dataclass(frozen=True, kw_only=True)
class Fields:
    """Where a record keeps each part. `prompt` may hold text or a list of chat messages
    (`{"role", "content"}`); `response` text (or a list of messages whose last one is the
    assistant's reply)."""

    prompt: str
    response: str
    reward: str
    sample_id: str | None = None
    group: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "response": self.response,
            "reward": self.reward,
            "sample_id": self.sample_id,
            "group": self.group,
        }


# Field names of common rollout dumps.
PRESETS: dict[str, Fields] = {
    # Our own default, and what most ad-hoc dumps use.
    "generic": Fields(prompt="prompt", response="response", reward="reward"),
    # verl's trainer.rollout_data_dir / validation dumps: the prompt is the decoded (already
    # chat-rendered) input, the score is the reward function's output.
    "verl": Fields(prompt="input", response="output", reward="score"),
    # TRL datasets: `prompt` (text or messages) and `completion`; the reward under `reward`.
    "trl": Fields(prompt="prompt", response="completion", reward="reward"),
    # OpenRLHF-style records: the prompt under `input` (its --input_key default), `output`, `reward`.
    "openrlhf": Fields(prompt="input", response="output", reward="reward"),
}


class Tokenizer(Protocol):
    sha256: str
    vocab_size: int

    def render_prompt(self, prompt: str | list[dict[str, str]], chat_template: str) -> tuple[str, bool]:
        """The prompt as the actor saw it, and whether a chat template was applied."""

    def encode_prompt(self, text: str, templated: bool) -> list[int]: ...

    def encode_response(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class TextRollout:
    where: str
    prompt: str | list[dict[str, str]]
    response: str
    reward: float
    sample_id: str | None
    group: str | None


def _text_of_response(value: Any, where: str, field_name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        last = value[-1]
        if last.get("role") == "assistant" and isinstance(content := last.get("content"), str):
            return content
    raise InputError(
        where,
        f"field {field_name!r} must be a response text (or messages ending with the assistant's), got {show(value)}",
    )


# The roles chat templates are written for (OpenAI's chat format and the tool roles of open
# models' templates). Any other role, or an empty one, is refused: templates render it as a role
# the actor never saw, or drop the message without a word.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def _prompt_value(value: Any, where: str, field_name: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise InputError(
                    where,
                    f"field {field_name!r}[{i}] must be a chat message {{'role': str, 'content': str}}, got {show(m)}",
                )
            if m["role"] not in CHAT_ROLES:
                raise InputError(
                    where,
                    f"field {field_name!r}[{i}] has role {show(m['role'])}, not a chat role ({', '.join(CHAT_ROLES)}): "
                    "the template would render a prompt the actor never saw",
                )
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise InputError(
        where, f"field {field_name!r} must be a prompt text or a non-empty list of chat messages, got {show(value)}"
    )


def _record(obj: Any, where: str, fields: Fields) -> TextRollout:
    if not isinstance(obj, dict):
        raise InputError(where, f"a rollout record must be a JSON object, got {show(obj)}")
    for name in (fields.prompt, fields.response, fields.reward):
        if name not in obj:
            raise InputError(
                where,
                f"missing field {name!r} (record keys: {sorted(obj)[:12]}); name the field with "
                "--prompt-field/--response-field/--reward-field or pick a --preset",
            )
    reward = obj[fields.reward]
    if not is_number(reward) or not math.isfinite(float(reward)):
        raise InputError(where, f"field {fields.reward!r} must be a finite number, got {show(reward)}")
    sample_id = group = None
    if fields.sample_id is not None:
        sample_id = obj.get(fields.sample_id)
        if not isinstance(sample_id, str) or not sample_id:
            raise InputError(where, f"field {fields.sample_id!r} must be a non-empty string, got {show(sample_id)}")
    if fields.group is not None:
        g = obj.get(fields.group)
        if g is None or isinstance(g, (dict, list)):
            raise InputError(
                where, f"field {fields.group!r} must be a string or number naming the prompt group, got {show(g)}"
            )
        group = str(g)
    return TextRollout(
        where=where,
        prompt=_prompt_value(obj[fields.prompt], where, fields.prompt),
        response=_text_of_response(obj[fields.response], where, fields.response),
        reward=float(reward),
        sample_id=sample_id,
        group=group,
    )


def read_rollouts(path: Path, fields: Fields) -> Iterator[TextRollout]:
    """Records of one JSONL or Parquet file, each located (`path:line` / `path:row N`)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(str(path), "rollout file does not exist")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            row = 0
            for batch in pf.iter_batches(batch_size=1024):
                for obj in batch.to_pylist():
                    yield _record(obj, f"{path}:row {row}", fields)
                    row += 1
        except (pa.ArrowException, OSError) as exc:
            raise InputError(str(path), f"unreadable Parquet file: {exc}") from None
        return
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip(b" \t\r\n"):
                continue
            where = f"{path}:{lineno}"
            try:
                obj = loads(line, where)
            except RecursionError:
                raise InputError(where, "JSON nested too deeply") from None
            yield _record(obj, where, fields)


@dataclass
class _Row:
    sample_id: str
    group: str
    tokens: list[int]
    response_length: int
    reward: float
    where: str


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    manifest: Path
    train_rows: int
    heldout_rows: int
    train_groups: int
    heldout_groups: int
    reward_range: tuple[float, float]
    reward_range_source: str
    label_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    longest_row_tokens: int = 0
    longest_row_where: str = ""


def split_groups(groups: Iterable[str], fraction: float, seed: int) -> set[str]:
    """The held-out group keys: groups ordered by sha256(seed, key), the first round(fraction x n)
    (at least one group on each side when fraction > 0)."""
    unique = sorted(set(groups), key=lambda g: hashlib.sha256(f"{seed}\0{g}".encode()).hexdigest())
    if fraction <= 0:
        return set()
    if len(unique) < 2:
        raise InputError("--heldout-fraction", f"a held-out split needs at least 2 prompt groups, found {len(unique)}")
    k = min(max(1, round(fraction * len(unique))), len(unique) - 1)
    return set(unique[:k])


def _label(x: float) -> str:
    return repr(float(x))


def _default_id_prefixes(inputs: Sequence[Path]) -> dict[str, str]:
    """The prefix of each input's default sample ids (keyed by the path as its records name it):
    its file stem, or, where two inputs share a stem, its path relative to the inputs' common folder
    without the suffix (`d1/r`, `d2/r`). The same file given twice keeps one prefix (its records
    then repeat ids, refused by name)."""
    stems = [p.stem for p in inputs]
    if len(set(stems)) == len(stems):
        return {str(p): p.stem for p in inputs}
    resolved = [p.resolve() for p in inputs]
    common = Path(os.path.commonpath([str(r.parent) for r in resolved]))
    return {str(p): r.relative_to(common).with_suffix("").as_posix() for p, r in zip(inputs, resolved, strict=True)}


def _check_imported_row(
    sid: str,
    tokens: list[int],
    response_length: int,
    reward: float,
    where: str,
    objective: Objective,
    vocab_size: int | None,
    max_seq_len: int | None,
) -> None:
    """`rows.check_row`'s verdict on the row this record becomes, at the record's location. The
    row's values are judged with numpy (ids, length, the one reward); only a row that breaks a rule
    goes through `check_row`, which names the rule and the value (per-token Python checks would cost
    more than the tokenizer on long rows)."""
    ids = np.asarray(tokens, dtype=np.int64)
    low, high = objective.reward_range
    ok = (
        ids.size >= 2
        and 1 <= response_length < ids.size
        and int(ids.min()) >= 0
        and (vocab_size is None or int(ids.max()) < vocab_size)
        and (max_seq_len is None or ids.size <= max_seq_len)
        and math.isfinite(reward)
        and (low <= reward <= high if objective.loss_type == "classification" else abs(reward) <= MAX_ABS_VALUE)
    )
    try:
        sid.encode("utf-8")
    except UnicodeEncodeError:
        ok = False
    if not ok:
        row = {"sample_id": sid, "tokens": tokens, "response_length": response_length}
        check_row(
            {**row, "returns": [reward] * response_length},
            where,
            objective,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
        )
        raise InputError(where, "the imported row breaks a dataset rule")  # check_row names it; not reached


def _at_input(exc: InputError, staged: Path, rows: Sequence[_Row]) -> InputError:
    """A refusal of a staged file's line, located at the input row it was made from."""
    prefix = f"{staged}:"
    if exc.where.startswith(prefix) and exc.where[len(prefix) :].isdigit():
        k = int(exc.where[len(prefix) :]) - 1  # staged files have one row per line, no blank lines
        if 0 <= k < len(rows):
            return InputError(rows[k].where, f"{exc.message} (in the imported row)")
    return InputError(exc.where, exc.message)


def import_rollouts(
    inputs: Sequence[str | Path],
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    fields: Fields,
    preset: str | None = None,
    chat_template: str = "auto",
    heldout_fraction: float = 0.1,
    seed: int = 0,
    reward_range: tuple[float, float] | str | None = None,
    loss_type: str = "classification",
    num_bins: int = 51,
    name: str = "rollouts",
    tokenizer_path: str | None = None,
    max_seq_len: int | None = None,
    inbox: str | Path | None = None,
    training: Mapping[str, Any] | None = None,
) -> ImportResult:
    """Read, tokenize, split and write; nothing is written unless every record is valid.

    `inbox`: write the manifest there (the folder the sensor watches), its dataset paths relative
    to it, instead of into `out`; it is written last, atomically and never over an existing file,
    so the sensor never sees a manifest before its data. `training`: the lineage's training spec
    (docs/rules.md#training-spec), embedded as the manifest's `training` object."""
    if not inputs:
        raise InputError("INPUT", "give at least one rollout file")
    if not (0.0 <= heldout_fraction < 1.0):
        raise InputError("--heldout-fraction", f"must be in [0, 1), got {heldout_fraction!r}")
    if chat_template not in ("auto", "always", "never"):
        raise InputError("--chat-template", f"must be auto, always or never, got {chat_template!r}")
    plain_name(name, "--name")  # the manifest's file name inside --out (or --inbox), never a path
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(str(out), "output folder exists and is not empty; import-rollouts never overwrites")
    inbox_manifest = None
    if inbox is not None:
        inbox_manifest = confined(inbox, f"{name}.json", "--name")
        if inbox_manifest.exists() or inbox_manifest.is_symlink():
            raise InputError(str(inbox_manifest), "a manifest of this name is already in the watched folder; "
                             "import-rollouts never overwrites (choose another --name)")  # fmt: skip
    input_facts = []
    records: list[TextRollout] = []
    for p in inputs:
        p = Path(p)
        before = len(records)
        records.extend(read_rollouts(p, fields))
        input_facts.append({"path": str(p), "sha256": sha256_file(p), "records": len(records) - before})
    if not records:
        raise InputError(", ".join(map(str, inputs)), "no rollout records found")

    rewards = [r.reward for r in records]
    if reward_range == "auto":
        low, high = min(rewards), max(rewards)
        if not low < high:
            raise InputError(
                "--reward-range auto", f"every reward equals {low!r}: a constant return has nothing to learn and no EV"
            )
        source = "auto"
    elif reward_range is None:
        low, high, source = 0.0, 1.0, "default"
    else:
        low, high = float(reward_range[0]), float(reward_range[1])
        source = "given"
    objective = Objective.from_json(
        {"loss_type": loss_type, "num_bins": num_bins, "reward_range": [low, high]},
        where="--reward-range/--loss-type/--num-bins",
    )
    if objective.loss_type == "classification":
        for r in records:
            if not (low <= r.reward <= high):
                raise InputError(
                    r.where,
                    f"reward {r.reward!r} is outside the objective's reward_range [{low!r}, {high!r}]; "
                    f"give --reward-range LOW HIGH or --reward-range auto",
                )

    rows: list[_Row] = []
    seen: dict[str, str] = {}
    templated_any = False
    id_prefix = _default_id_prefixes([Path(p) for p in inputs])
    longest: tuple[int, str] = (0, "")
    for r in records:
        try:
            text, templated = tokenizer.render_prompt(r.prompt, chat_template)
        except InputError as exc:  # the template (or the choice of it) refused this record's prompt
            raise InputError(r.where, f"{exc.where}: {exc.message}" if exc.where else exc.message) from None
        templated_any |= templated
        prompt_ids = tokenizer.encode_prompt(text, templated)
        response_ids = tokenizer.encode_response(r.response)
        if not prompt_ids:
            raise InputError(r.where, "the prompt tokenizes to no tokens")
        if not response_ids:
            raise InputError(r.where, "the response tokenizes to no tokens (an empty response has no value targets)")
        tokens = [int(t) for t in prompt_ids] + [int(t) for t in response_ids]
        if max_seq_len is not None and len(tokens) > max_seq_len:
            raise InputError(r.where, f"{len(tokens)} tokens exceed --max-seq-len {max_seq_len}")
        if len(tokens) > longest[0]:
            longest = (len(tokens), r.where)
        file_part, line_part = r.where.rsplit(":", 1)
        sid = r.sample_id if r.sample_id is not None else f"{id_prefix[file_part]}:{line_part.replace('row ', 'r')}"
        if sid in seen:
            raise InputError(r.where, f"sample id {sid!r} repeats {seen[sid]}")
        seen[sid] = r.where
        group = r.group if r.group is not None else text
        # The dataset rules training applies (docs/rules.md#dataset), here at the input's location:
        # a row refused now is never found later in a staged file the user never saw.
        _check_imported_row(
            sid, tokens, len(response_ids), r.reward, r.where, objective, tokenizer.vocab_size, max_seq_len
        )
        rows.append(_Row(sid, group, tokens, len(response_ids), r.reward, r.where))

    held = split_groups((r.group for r in rows), heldout_fraction, seed)
    splits = {"train": [r for r in rows if r.group not in held], "heldout": [r for r in rows if r.group in held]}

    n_groups = {s: len({r.group for r in v}) for s, v in splits.items()}
    with staged_folder(out) as tmp:
        refs: dict[str, Any] = {}
        label_counts: dict[str, dict[str, int]] = {}
        for split, split_rows in splits.items():
            if not split_rows:
                continue
            path = tmp / f"{split}.jsonl"
            counts: dict[str, int] = {}
            with staged_file(path, shown_as=out / path.name) as f:
                for row in split_rows:
                    f.write(
                        json.dumps(
                            {
                                "sample_id": row.sample_id,
                                "tokens": row.tokens,
                                "response_length": row.response_length,
                                "returns": [row.reward] * row.response_length,
                            },
                            separators=(",", ":"),
                            ensure_ascii=False,
                        ).encode()
                        + b"\n"
                    )
                    counts[_label(row.reward)] = counts.get(_label(row.reward), 0) + 1
            refs[split] = {"path": path.name, "sha256": sha256_file(path), "num_samples": len(split_rows)}
            label_counts[split] = dict(sorted(counts.items()))
        manifest = {
            "schema": SCHEMA,
            "train": refs["train"],
            "heldout": refs.get("heldout"),
            "objective": objective.canonical(),
            "provenance": {
                "importer": IMPORTER,
                "inputs": input_facts,
                "tokenizer": {
                    "path": tokenizer_path,
                    "sha256": tokenizer.sha256,
                    "chat_template_applied": templated_any,
                },
                "fields": fields.to_json(),
                "preset": preset,
                "reward": {"broadcast": "the record's reward to every response token", "range_source": source},
                "split": {
                    "rule": "by prompt group: groups ordered by sha256(seed, key), first round(fraction x groups) held "
                    "out",
                    "group_key": fields.group or "rendered prompt text",
                    "seed": seed,
                    "heldout_fraction": heldout_fraction,
                    "train_groups": n_groups["train"],
                    "heldout_groups": n_groups["heldout"],
                },
                "label_counts": label_counts,
                "max_seq_len": max_seq_len,
                "longest_row_tokens": longest[0],
            },
        }
        if training is not None:
            manifest["training"] = dict(training)
        manifest_path = confined(tmp, f"{name}.json", "--name")
        with staged_file(manifest_path, shown_as=out / manifest_path.name) as f:
            f.write(canonical_bytes(manifest))
        # Everything written is checked by the same validator training uses, before it is published.
        from value_assets.core.dataset import validate_dataset
        from value_assets.core.manifest import load_manifest

        # Every row already passed the same rules at its input's location; a refusal here is named
        # at the input row too, never in the staged file that is about to be removed.
        loaded = load_manifest(manifest_path)
        for ref in loaded.splits():
            try:
                validate_dataset(ref, loaded.objective, vocab_size=tokenizer.vocab_size, max_seq_len=max_seq_len)
            except InputError as exc:
                raise _at_input(exc, ref.path, splits[ref.split]) from None
        if inbox_manifest is not None:
            # The manifest moves to the watched folder, its dataset paths re-based there (and
            # checked again where it will be read).
            relative = os.path.relpath(out.resolve(), inbox_manifest.parent.resolve())
            for split_name in ("train", "heldout"):
                if manifest.get(split_name):
                    manifest[split_name]["path"] = f"{relative}/{manifest[split_name]['path']}"
            manifest_path.unlink()
    if inbox_manifest is not None:
        written = False
        try:
            write_new(inbox_manifest, canonical_bytes(manifest))  # the data is in place: the sensor may see it now
            written = True
            load_manifest(inbox_manifest, pinned_sha256=sha256_bytes(canonical_bytes(manifest)))
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)  # nothing written on a refusal: the data goes too
            if written:
                inbox_manifest.unlink(missing_ok=True)
            raise
    return ImportResult(
        manifest=inbox_manifest or out / f"{name}.json",
        train_rows=len(splits["train"]),
        heldout_rows=len(splits["heldout"]),
        train_groups=n_groups["train"],
        heldout_groups=n_groups["heldout"],
        reward_range=(low, high),
        reward_range_source=source,
        label_counts=label_counts,
        longest_row_tokens=longest[0],
        longest_row_where=longest[1],
    )
