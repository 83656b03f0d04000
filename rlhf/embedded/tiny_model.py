"""The embedded default model: a tiny Llama built from a config, with an optional cached SFT warm start.

Real DPO starts from an SFT model, and so does the embedded default: the first time a spec is used, the
model is fine-tuned for ``warm_start_steps`` on the embedded task's demonstrations and saved under
``cache_dir``; later runs load it (a few hundred milliseconds). The cache key covers everything that
changes the result, so editing the spec builds a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from rlhf.algos.sft import SFT, nll_loss
from rlhf.core.file_io import use_umask
from rlhf.data.tasks import ReverseTask
from rlhf.models.loading import HEADS, Policy
from rlhf.models.tokenizer import VOCAB_SIZE, byte_tokenizer
from rlhf.ops.completion_logps import completion_stats
from rlhf.optim import linear_with_warmup


class TinySpec:
    """A tiny Llama-architecture causal LM and its SFT warm start.

    Args:
        hidden_size: width of the residual stream.
        num_layers: transformer blocks.
        num_heads: attention heads.
        intermediate_size: width of the MLP.
        max_positions: longest sequence, in tokens.
        attention_dropout: dropout on the attention weights while training (0: none, the default).
        init_seed: seed of the random initialization and of the warm start's batches.
        warm_start_steps: SFT steps on `task` before the run starts (0: random init, no cache).
        warm_start_lr: peak AdamW learning rate of the warm start.
        warm_start_batch_size: demonstrations per warm-start step.
        cache_dir: where warm-started models are kept.
        task: the embedded task the warm start learns from.
    """

    def __init__(
        self,
        hidden_size: int = 128,
        num_layers: int = 3,
        num_heads: int = 4,
        intermediate_size: int = 512,
        max_positions: int = 1024,
        attention_dropout: float = 0.0,
        init_seed: int = 0,
        warm_start_steps: int = 150,
        warm_start_lr: float = 1e-3,
        warm_start_batch_size: int = 64,
        cache_dir: str = "~/.cache/rlhf",
        task: ReverseTask | None = None,
    ) -> None:
        self.arch = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
                     "intermediate_size": intermediate_size, "max_positions": max_positions}
        if attention_dropout:  # only when set, so that the default's cache key stays the same
            self.arch["attention_dropout"] = attention_dropout
        self.init_seed = init_seed
        self.warm_start = {"steps": warm_start_steps, "lr": warm_start_lr, "batch_size": warm_start_batch_size}
        self.cache_dir = Path(os.path.expanduser(cache_dir))
        self.task = task if task is not None else ReverseTask()

    def config(self) -> LlamaConfig:
        a = self.arch
        tok = byte_tokenizer()
        return LlamaConfig(
            vocab_size=VOCAB_SIZE + 1, hidden_size=a["hidden_size"], intermediate_size=a["intermediate_size"],
            num_hidden_layers=a["num_layers"], num_attention_heads=a["num_heads"],
            num_key_value_heads=a["num_heads"], max_position_embeddings=a["max_positions"],
            attention_dropout=a.get("attention_dropout", 0.0), tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )

    def random_init(self) -> Policy:
        torch.manual_seed(self.init_seed)
        return Policy(LlamaForCausalLM(self.config()), byte_tokenizer())

    def cache_key(self) -> str:
        t = self.task
        blob = json.dumps({
            "arch": self.arch, "seed": self.init_seed, "warm_start": self.warm_start,
            "task": [type(t).__name__, t.min_chars, t.max_chars, t.num_train, t.eval_one_in, t.seed],
            "versions": [torch.__version__, transformers.__version__, 1],
        }, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def build(self, head: str = "causal_lm") -> Policy:
        """The warm-started model from the cache, training and caching it first if needed, with ``head`` (a key of
        :data:`rlhf.models.loading.HEADS`) on top."""
        if self.warm_start["steps"] == 0:
            causal = self.random_init()
        else:
            folder = self.cache_dir / f"tiny-{self.cache_key()}"
            if not (folder / "config.json").exists():
                self._train_and_save(folder)
            causal = Policy(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
        return causal if HEADS[head].auto_class is AutoModelForCausalLM else self._with_head(causal, head)

    def _with_head(self, causal: Policy, head: str) -> Policy:
        """The warm-started (or random) causal LM's backbone under a freshly initialized ``head`` (seeded by
        ``init_seed``), as ``from_pretrained`` does for a Hub checkpoint saved with another head."""
        config = {k: v for k, v in causal.model.config.to_dict().items() if k not in ("id2label", "label2id")}
        config.update(HEADS[head].config)
        config = type(causal.model.config).from_dict(config)
        torch.manual_seed(self.init_seed)
        model = HEADS[head].auto_class.from_config(config)
        model.base_model.load_state_dict(causal.model.base_model.state_dict())
        return Policy(model, causal.tokenizer)

    def _train_and_save(self, folder: Path) -> None:
        policy = self.random_init()
        model, tokenizer = policy.model, policy.tokenizer
        # Every option spelled out: the recipe the cached warm starts were built with, bit for bit, whatever SFT's
        # defaults become (a default that changed the logits' layout once changed every fresh warm start).
        sft = SFT(completion_only_loss=True, max_prompt_length=512, max_length=1024, completion_logits_only=False,
                  fused_output_layer=False, padding_free=False)
        sft.setup(model, tokenizer)
        rows = [sft.tokenize(r, tokenizer) for r in self.task.rows("train", ("prompt", "completion"))]
        steps, batch_size = self.warm_start["steps"], self.warm_start["batch_size"]
        # Recipe measured to reach ~50% exact match in 150 steps on the default task and size.
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.warm_start["lr"], betas=(0.9, 0.98),
                                      weight_decay=0.01)
        scheduler = linear_with_warmup(optimizer, min(50, steps // 3), num_training_steps=steps * 4)
        generator = torch.Generator().manual_seed(self.init_seed)
        model.train()
        for _ in tqdm(range(steps), desc=f"tiny model: SFT warm start (cached in {self.cache_dir})"):
            index = torch.randint(len(rows), (batch_size,), generator=generator).tolist()
            batch = sft.collate([rows[i] for i in index])
            stats = completion_stats(model, batch)
            nll_loss(stats.token_logps, stats.mask).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        # Write next to the destination, then rename: a crash never leaves a half-written cache entry.
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        use_umask(staging)  # mkdtemp makes it 0700, safetensors writes 0600: a shared cache needs the umask's modes
        try:
            os.replace(staging, folder)
        except OSError:  # another process finished first; theirs is identical
            shutil.rmtree(staging, ignore_errors=True)
