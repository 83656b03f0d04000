"""A ``step()`` API for custom loops (generate, filter, train, repeat), in the spirit of TRL's former
IterativeSFTTrainer: :class:`StepTrainer`.

It is built from the same config as a run (:func:`rlhf.run.components.build_run`: model, optimizer, schedule, hardware
strategy) and each :meth:`StepTrainer.step` is one optimizer step through the loop's own
:func:`rlhf.run.loop.train_step` (accumulation, clipping, non-finite handling, the schedule), on the rows the caller
gives instead of the training split. The loss is the SFT algorithm's (``algo=sft``): negative log-likelihood of the
label tokens. One process only (``hardware=cpu`` or ``gpu``).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import send_to_device
from omegaconf import DictConfig, OmegaConf

from rlhf.algos.sft import SFT
from rlhf.config import tuned_defaults
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build
from rlhf.core.train_state import TrainState
from rlhf.data.encoding import encode, tokens
from rlhf.models.generation import eager_layers, gathered_for_generation, plain_defaults, stop_ids
from rlhf.run import checkpoint
from rlhf.run.components import BuiltRun, build_run
from rlhf.run.loop import train_step, window_metrics
from rlhf.run.nonfinite import CAUSES, NonFinite
from rlhf.run.optimizer_modes import check_reaches, evaluation_weights, training_weights
from rlhf.telemetry.loggers import Loggers

log = logging.getLogger(__name__)

CONF = Path(__file__).resolve().parents[2] / "conf"  # the checkout's (or editable install's) config folder
IGNORE = -100  # a label that is not learned (Hugging Face's convention)
# How a row longer than max_length is cut (TRL's names): keep its last tokens, or its first ones.
TRUNCATIONS = {"keep_end": lambda row, n: row[-n:], "keep_start": lambda row, n: row[:n]}


class _NoStop:
    signum = None  # the loop's stop request: a custom loop stops by not calling step() again


class _Given:
    """The micro-batches of one step, in the shape of a batch source (``next()``)."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self._batches = iter(batches)

    def next(self) -> dict[str, torch.Tensor]:
        return next(self._batches)


class StepTrainer:
    """One optimizer step per :meth:`step` call on the rows given, with the optimizer, schedule, clipping and
    hardware of a run's config.

    Args:
        overrides: Hydra overrides composed on ``conf/config.yaml``, as on the command line (``algo=sft`` is
            added unless an ``algo=`` is given; the step's loss is SFT's).
        run_dir: a run folder for ``metrics.jsonl`` (one line per step, the loop's metric names) and the
            default of :meth:`save`; ``None``: a temporary folder, removed by :meth:`close`, and no metrics file.
        max_length: tokens a row keeps (prompt + completion); ``None``: ``algo.max_length`` (itself ``null`` for no
            limit).
        truncation_mode: how a longer row is cut: ``keep_end`` keeps its last ``max_length`` tokens (TRL's
            default), ``keep_start`` its first.
        optimize_device_cache: after every step, collect garbage and give the device's cached memory back
            (``strategy.empty_cache()``, as ``train.empty_cache_every_steps=1`` does in a run): less memory held
            between steps (generation gets it), some speed lost. ``False``: tensors stay cached on the device
            between calls, and ``train.empty_cache_every_steps`` applies as in a run.
        config_dir: the folder of ``config.yaml`` (default: this checkout's ``conf/``).
    """

    def __init__(self, overrides: Sequence[str] = (), *, run_dir: str | Path | None = None,
                 max_length: int | None = None, truncation_mode: str = "keep_end",
                 optimize_device_cache: bool = False, config_dir: str | Path | None = None) -> None:
        from hydra import compose, initialize_config_dir

        overrides = list(overrides)
        if not any(o.lstrip("+~").startswith("algo=") for o in overrides):
            overrides.insert(0, "algo=sft")
        with initialize_config_dir(config_dir=str(Path(config_dir or CONF).resolve()), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, "output_dir=unused"])
        self._start(cfg, run_dir, max_length, truncation_mode, optimize_device_cache, overrides)

    @classmethod
    def from_config(cls, cfg: DictConfig, *, run_dir: str | Path | None = None, max_length: int | None = None,
                    truncation_mode: str = "keep_end", optimize_device_cache: bool = False) -> StepTrainer:
        """A trainer from a composed config (its ``algo`` must be ``sft``; ``output_dir`` is replaced by
        ``run_dir``). The other arguments are the constructor's."""
        trainer = cls.__new__(cls)
        trainer._start(cfg.copy(), run_dir, max_length, truncation_mode, optimize_device_cache)
        return trainer

    # --- building ------------------------------------------------------------------------------------------
    def _start(self, cfg: DictConfig, run_dir, max_length, truncation_mode: str, optimize_device_cache: bool,
               overrides: list[str] | None = None) -> None:
        if truncation_mode not in TRUNCATIONS:
            raise UserError(f"truncation_mode={truncation_mode!r} is not one of {list(TRUNCATIONS)}. Fix: "
                            "truncation_mode='keep_end' (keep a row's last tokens) or 'keep_start' (its first).")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise UserError(f"max_length={max_length!r}: a row needs at least 2 tokens to learn from one. Fix: "
                            "max_length=None (algo.max_length) or a whole number >= 2.")
        self._tmp = None if run_dir is not None else tempfile.TemporaryDirectory(prefix="rlhf-step-")
        self.run_dir = Path(run_dir if run_dir is not None else self._tmp.name).resolve()
        OmegaConf.update(cfg, "output_dir", str(self.run_dir), force_add=True)
        check_config(cfg)
        # defaults tuned on the embedded model left on another one (None overrides: a composed config, read as is)
        model = next((o.split("=", 1)[1] for o in overrides or () if o.startswith("model=")), None)
        tuned = tuned_defaults.warning(cfg, overrides, model)
        if tuned:
            log.warning("%s", tuned)
        algo = build(cfg.algo)
        if not isinstance(algo, SFT):
            raise UserError(f"step() trains with the SFT loss, but the config's algo is {type(algo).__name__}. "
                            "Fix: algo=sft (the default of StepTrainer(overrides=...) when no algo= is given).")
        strategy = build(cfg.hardware)
        if strategy.processes() > 1:
            raise UserError(f"StepTrainer runs in this one process; hardware asks for {strategy.processes()}. "
                            "Fix: hardware=cpu (or gpu).")
        strategy.start(seed=cfg.seed)
        self.cfg = cfg
        self.run: BuiltRun = build_run(cfg, strategy, self.run_dir)
        self.state = TrainState()
        check_reaches(self.run.optimizer, self.run.model)
        training_weights(self.run.optimizer)  # an optimizer with train/eval modes starts in train mode
        self.max_length = max_length if max_length is not None else self.run.algo.max_length
        self.truncation_mode, self.optimize_device_cache = truncation_mode, optimize_device_cache
        self._warned_schedule = False
        self._logger = None
        if run_dir is not None:
            self._logger = Loggers([build(node) for node in (cfg.get("logger") or {}).values()])
            self._logger.start(str(self.run_dir), OmegaConf.to_container(cfg, resolve=True))

    @property
    def model(self) -> torch.nn.Module:
        """The Hugging Face model being trained (for ``generate`` or inspection)."""
        return self.run.strategy.unwrap(self.run.model)

    @property
    def tokenizer(self):
        return self.run.tokenizer

    @property
    def global_step(self) -> int:
        """Optimizer steps done (skipped non-finite steps included)."""
        return self.state.step

    # --- the step ------------------------------------------------------------------------------------------
    def step(self, input_ids: Any = None, attention_mask: Any = None, labels: Any = None,
             texts: Sequence[str] | None = None, texts_labels: Sequence[str] | None = None) -> dict[str, float]:
        """One optimizer step on the rows given, as token ids or as texts; return its metrics (the loop's names:
        ``train/loss``, ``train/grad_norm``, ``train/lr``, ``perf/tokens_per_s`` ...).

        Token ids: ``input_ids`` a list of 1-D tensors (or lists of ints), or a padded ``[B, T]`` tensor;
        ``attention_mask`` (same shapes; 1 on the tokens, left or right padding) or ``None`` (every token);
        ``labels`` the same shapes with ``-100`` on tokens not learned, else equal to ``input_ids``, or ``None``
        (every token learned).

        Texts: ``texts`` a list of strings; with ``texts_labels`` (as many strings) each text is a prompt and its
        label the completion learned after it (the prompt is not learned); without, the whole text is learned.
        Either way EOS ends what is learned, as in ``algo=sft``'s rows.

        The rows (cut to ``max_length`` by ``truncation_mode``) are one optimizer step: split into
        ``ceil(rows / train.per_device_batch_size)`` micro-batches of near-equal size, each weighted equally.
        """
        rows = self._rows(input_ids, attention_mask, labels, texts, texts_labels)
        rows = [self._truncate(i, ids, mask) for i, (ids, mask) in enumerate(rows)]
        size = self.run.settings.per_device_batch_size
        count = -(-len(rows) // size)
        bounds = [len(rows) * k // count for k in range(count + 1)]
        device = self.run.accelerator.device
        batches = [send_to_device(self.run.algo.collate([{"input_ids": ids, "completion_mask": mask}
                                                    for ids, mask in rows[a:b]]), device)
                   for a, b in zip(bounds, bounds[1:])]
        self.run.model.train()
        start = time.perf_counter()
        outcome = train_step(self.run, self.state, _Given(batches), _NoStop(), accumulation=count)
        metrics = window_metrics(self.run, self.state, outcome.grad_norm, time.perf_counter() - start)
        self.state.new_window()
        self.state.last.update(metrics)
        if self._logger is not None:
            self._logger.log(metrics, self.state.step)
        every = self.run.settings.empty_cache_every_steps
        if self.optimize_device_cache or (every and self.state.step % every == 0):
            self.run.strategy.empty_cache()
        if self.state.step > self.run.max_steps and not self._warned_schedule:
            self._warned_schedule = True
            log.warning("step %d is past train.max_steps=%d, the length of the learning-rate schedule; set "
                        "train.max_steps to the steps you will make, or use scheduler=constant",
                        self.state.step, self.run.max_steps)
        return metrics

    def _rows(self, input_ids, attention_mask, labels, texts, texts_labels) -> list[tuple[list[int], list[int]]]:
        """The given rows as (token ids, 1 where the next-token loss applies) pairs, padding removed."""
        if (input_ids is None) == (texts is None):
            raise UserError("step() takes either input_ids= (with attention_mask=, labels=) or texts= (with "
                            "texts_labels=): " + ("both were given." if texts is not None else "neither was given.")
                            + " Fix: pass one of the two.")
        if texts is not None:
            if attention_mask is not None or labels is not None:
                raise UserError("step(texts=...) builds its own attention mask and labels. Fix: drop attention_mask="
                                " and labels=, or pass input_ids= instead of texts=.")
            return self._text_rows(texts, texts_labels)
        if texts_labels is not None:
            raise UserError("step(texts_labels=...) goes with texts=, not input_ids=. Fix: pass labels= (token ids, "
                            "-100 where not learned) with input_ids=, or texts= with texts_labels=.")
        ids = _as_rows(input_ids, "input_ids")
        masks = _as_rows(attention_mask, "attention_mask", like=ids) if attention_mask is not None else None
        targets = _as_rows(labels, "labels", like=ids) if labels is not None else None
        rows = []
        for i, row in enumerate(ids):
            keep = [j for j in range(len(row)) if masks is None or masks[i][j]]
            if targets is not None:
                wrong = [j for j in keep if targets[i][j] not in (IGNORE, row[j])]
                if wrong:
                    raise UserError(f"labels[{i}][{wrong[0]}]={targets[i][wrong[0]]} is neither -100 nor input_ids"
                                    f"[{i}][{wrong[0]}]={row[wrong[0]]}: for a causal language model the labels are "
                                    "the input ids, with -100 where a token is not learned (the shift to the next "
                                    "token happens inside). Fix: labels = input_ids with -100 on the prompt.")
            rows.append(([row[j] for j in keep],
                         [int(targets is None or targets[i][j] != IGNORE) for j in keep]))
        return rows

    def _text_rows(self, texts, texts_labels) -> list[tuple[list[int], list[int]]]:
        texts = _as_strings(texts, "texts")
        if texts_labels is not None:
            texts_labels = _as_strings(texts_labels, "texts_labels")
            if len(texts_labels) != len(texts):
                raise UserError(f"step() got {len(texts)} texts and {len(texts_labels)} texts_labels: each text (a "
                                "prompt) needs its label (the completion learned after it). Fix: pass lists of the "
                                "same length, or texts_labels=None to learn the whole texts.")
        algo, rows = self.run.algo, []
        for i, text in enumerate(texts):
            prompt, completion = (text, texts_labels[i]) if texts_labels is not None else ("", text)
            out = encode(self.run.tokenizer, prompt, completion, algo.max_prompt_length, None)
            mask = out["completion_mask"] if algo.completion_only_loss else [1] * len(out["input_ids"])
            rows.append((out["input_ids"], mask))
        return rows

    def _truncate(self, index: int, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        if self.max_length is not None and len(ids) > self.max_length:
            cut = TRUNCATIONS[self.truncation_mode]
            ids, mask = cut(ids, self.max_length), cut(mask, self.max_length)
        if not any(mask[1:]):  # the first token is never predicted
            raise UserError(f"row {index} has no token left to learn from ({len(ids)} token(s) after max_length="
                            f"{self.max_length}, truncation_mode={self.truncation_mode!r}, label tokens masked). "
                            "Fix: a larger max_length, truncation_mode='keep_end' (keeps the completion), or "
                            "leave the row out.")
        return ids, mask

    # --- around the steps ----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[str], max_new_tokens: int = 32, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, do_sample: bool = True,
                 num_return_sequences: int = 1) -> list[str]:
        """Completions of ``prompts`` with ``model.generate`` (left padding; ``top_k=0, top_p=1.0``: plain
        temperature sampling), ``num_return_sequences`` per prompt, in order, decoded without special tokens.
        Seeded by the global torch generator (``torch.manual_seed``). Layers compiled for training
        (``hardware.compile=layers``) run eagerly here, as in a run's sampling
        (:func:`rlhf.models.generation.eager_layers`): no graph compiled per layer and cache length."""
        prompts = _as_strings(prompts, "prompts")
        tokenizer, model, device = self.run.tokenizer, self.model, self.run.accelerator.device
        encoded = [tokens(tokenizer, p) for p in prompts]  # with the tokenizer's special tokens, as in training
        longest = max(len(e) for e in encoded)
        ids = torch.tensor([[tokenizer.pad_token_id] * (longest - len(e)) + e for e in encoded], device=device)
        mask = torch.tensor([[0] * (longest - len(e)) + [1] * len(e) for e in encoded], device=device)
        stops = list(stop_ids(tokenizer, model)) or None  # the tokenizer's EOS and the model's end-of-turn ids
        model.eval()
        try:  # a sharded model's parameters gathered once for the generation (FSDP2, ZeRO-3), not at every token
            # only the settings given here, not the model's generation_config.json; compiled layers run eagerly
            with (evaluation_weights(self.run.optimizer), self.run.accelerator.autocast(),
                  gathered_for_generation(self.run.model) as still_sharded, plain_defaults(model), eager_layers()):
                sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p} if do_sample else {}
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     do_sample=do_sample, **sampling,  # greedy: no sampling settings to warn about
                                     num_return_sequences=num_return_sequences, synced_gpus=still_sharded,
                                     pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=stops)
        finally:
            model.train()
        return tokenizer.batch_decode(out[:, longest:], skip_special_tokens=True)

    def evaluate(self) -> dict[str, float]:
        """The loop's held-out evaluation (``eval/*``: for ``algo=sft`` ``eval/loss``, ``eval/exact_match`` ...)."""
        with evaluation_weights(self.run.optimizer):  # a schedule-free optimizer's evaluation weights
            metrics = self.run.evaluate()
        if self._logger is not None:
            self._logger.log(metrics, self.state.step)
        return metrics

    def save(self, path: str | Path | None = None) -> Path:
        """The model and tokenizer in Hugging Face format, as a run's ``final/`` (default: ``<run_dir>/final``)."""
        folder = Path(path) if path is not None else self.run_dir / "final"
        if not self.run.strategy.all_finite(self.run.model):
            raise NonFinite(f"step {self.state.step}: the model's parameters are not finite; {folder} was not "
                            "written. " + CAUSES)
        with evaluation_weights(self.run.optimizer):  # what is evaluated is what is saved
            self.run.strategy.save_model(self.run.model, self.run.tokenizer, folder,
                                         checkpoint.save_pretrained_atomically)
        return folder

    def close(self) -> None:
        """Close the metrics file (and remove the temporary folder when no run_dir was given)."""
        if self._logger is not None:
            self._logger.finish()
            self._logger = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> StepTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_strings(values, name: str) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Sequence) or not all(isinstance(v, str) for v in values):
        raise UserError(f"{name} must be a list of strings, got {type(values).__name__}. Fix: e.g. {name}=[...] "
                        "(one string per row).")
    if not values:
        raise UserError(f"{name} is empty: a step needs at least one row. Fix: skip the step() call when a "
                        "round kept nothing.")
    return list(values)


def _as_rows(values, name: str, like: list[list[int]] | None = None) -> list[list[int]]:
    """A padded ``[B, T]`` tensor or a list of 1-D tensors / lists as lists of ints (each as long as ``like``'s)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 2:
            raise UserError(f"{name} is a tensor of shape {list(values.shape)}; a step takes rows. Fix: a [B, T] "
                            "tensor, or a list of 1-D tensors (one per row).")
        rows = values.tolist()
    else:
        try:
            rows = [torch.as_tensor(v).tolist() for v in values]
        except (TypeError, ValueError) as error:
            raise UserError(f"{name}: {error}. Fix: a [B, T] tensor or a list of 1-D tensors.") from None
        if any(not isinstance(r, list) or any(isinstance(x, list) for x in r) for r in rows):
            raise UserError(f"{name} must hold 1-D rows. Fix: a [B, T] tensor or a list of 1-D tensors.")
    if not rows or (like is None and not any(rows)):
        raise UserError(f"{name} is empty: a step needs at least one row. Fix: skip the step() call when a round "
                        "kept nothing.")
    if like is not None and [len(r) for r in rows] != [len(r) for r in like]:
        raise UserError(f"{name} does not have the shape of input_ids ({len(rows)} rows of lengths "
                        f"{[len(r) for r in rows][:4]}... against {len(like)} of {[len(r) for r in like][:4]}...). "
                        f"Fix: one {name} row per input_ids row, each as long.")
    return [[int(x) for x in r] for r in rows]
