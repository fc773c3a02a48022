"""The draft model of `speculative_method = draft`, run by the ModelRunner (runner side).

A runner feature (`radixrt.executor.runner_features`): the scheduler plans a verify row as for
any proposer (KV reserved for k + 1 tokens, the row listed in `StepPlan.device_drafts`); in the
same step the runner calls
  1. `before_forward` (`propose`): the draft model runs k one-token steps over those rows
     (step j feeds the token at position start + j: the row's last token, then the draft
     just sampled, which stays on the device) and samples each draft from q = the draft's
     distribution under the row's sampling parameters (greedy rows: argmax); the drafts become
     the verify rows' input ids on the device (`StepContext.input_writes`) and the target
     runs over the whole batch;
  2. `after_forward` (`fill_kv_rest`): the draft model runs over the step's other rows
     (prefill chunks, plain decode rows) with the target's inputs; `propose` already wrote the
     verify rows' draft KV (one more one-token step feeds the last draft), so the draft KV is
     filled wherever the target's is;
  3. `after_sample`: verification (greedy: exact match in the sampler; sampling: rejection,
     `radixrt.executor.draft_verify`).
Drafts never travel to the host before verification. Verify rows still wait for their
result on the host before the next plan (their length depends on acceptance). The draft model
shares the runner's slot state (`radixrt.executor.slots`: block tables, last samples, sampling
parameters) as data; it is handed nothing else of the runner.

Draft KV lives in a second KVPool indexed by the SAME block ids as the target's pool (one block
table for both), so a cached prefix has draft KV too and copy-on-write copies both. Rolled-back
positions hold stale draft KV exactly where the target's is stale; both are overwritten when the
positions are fed again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixrt.attention import create_attention_backend
from radixrt.attention.forward_batch import ForwardBatch
from radixrt.config import EngineConfig, ModelConfig
from radixrt.executor.draft_check import check_draft_compatible
from radixrt.executor.draft_verify import DraftOutput, verify_stochastic
from radixrt.executor.inputs import StepLayout, layout_plan
from radixrt.executor.rejection import row_noise
from radixrt.executor.runner_features import RunnerFeature, StepContext
from radixrt.executor.sampler import sampling_probs
from radixrt.executor.slots import SlotState
from radixrt.kv.pool import KVPool
from radixrt.model import DTYPES, build_model
from radixrt.plan import CopyBlock, PlanRow, StepPlan

if TYPE_CHECKING:
    from radixrt.executor.result import StepOutputs

DRAFT_SALT = 1_000  # + step j: noise of draft j (distinct from the target's acceptance noise)


class DraftRunner(RunnerFeature):
    """The draft model, its attention backend and (after `on_pool`) its KV pool."""

    def __init__(
        self,
        cfg: EngineConfig,
        target_cfg: ModelConfig,
        max_model_len: int,
        slots: SlotState,
        generator: torch.Generator | None,
    ) -> None:
        """`slots`: the runner's slot state (shared, read only); `generator`: the noise of
        unseeded rows (None: torch's default)."""
        path = cfg.speculative.speculative_draft_model
        assert path is not None
        try:
            self.model_cfg = ModelConfig.from_pretrained(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"speculative_draft_model: {e}") from e
        check_draft_compatible(cfg.model_path, path, target_cfg, self.model_cfg)
        self.slots = slots
        self.generator = generator
        self.use_cuda_graphs = cfg.enable_cuda_graph
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.model = build_model(
            self.model_cfg,
            path,
            device=cfg.device,
            dtype=cfg.dtype,
            load_format=cfg.load_format,
            max_positions=max_model_len,
            seed=cfg.seed + 1,
            fp8=self.model_cfg.checkpoint_fp8,  # an fp8 draft checkpoint runs in fp8
            attention_backend=cfg.attention_backend,
        )
        self.backend = create_attention_backend(
            cfg.attention_backend, self.model_cfg, self.device, self.dtype
        )
        self.kv_head_dim: int = self.backend.kv_head_dim
        self.pool: KVPool | None = None
        self.cuda_graphs = None  # DecodeCudaGraphs of the draft (CUDA), see enable_cuda_graphs
        self.last_tokens: torch.Tensor | None = None  # [slots] int64: graph-step inputs
        # Recorded after each plan of the draft's attention backend: FlashInfer stages plan
        # data in pinned host buffers copied asynchronously, so the next plan (k + 1 per
        # step) waits until the previous copy ran (the runner's _inputs_on_device, per plan)
        self._planned: torch.cuda.Event | None = None

    # ---- hooks ----
    def kv_bytes_per_block(self, block_size: int) -> int:
        m = self.model_cfg
        return KVPool.bytes_per_block(
            m.num_layers, block_size, m.num_kv_heads, self.kv_head_dim, self.dtype
        )

    def on_pool(self, num_blocks: int, block_size: int, scratch_block: int | None) -> None:
        """Allocate the draft KV pool; capture its decode graphs when the target has graphs
        (`scratch_block`: theirs)."""
        self.allocate(num_blocks, block_size)
        if scratch_block is not None and self.use_cuda_graphs:
            from radixrt.executor.cuda_graph import DECODE_BUCKETS

            num_slots, max_blocks = self.slots.block_tables.shape
            self.enable_cuda_graphs(
                max_batch_size=min(num_slots, DECODE_BUCKETS[-1]),  # one-token draft steps
                max_blocks_per_seq=max_blocks,
                scratch_block=scratch_block,
                num_slots=num_slots,
            )

    def on_block_copy(self, op: CopyBlock) -> None:
        assert self.pool is not None
        self.pool.copy_prefix(op.src, op.dst, op.num_tokens)

    def before_forward(self, ctx: StepContext) -> None:
        drafted = self.propose(ctx.plan, ctx.layout, ctx.use_cuda_graph)
        if drafted is not None:
            ctx.drafted = drafted
            ctx.input_writes = (drafted.flat_index, self.draft_inputs(drafted))

    def after_forward(self, ctx: StepContext, fb: ForwardBatch | None) -> None:
        self.fill_kv_rest(ctx.plan, ctx.layout, fb, ctx.drafted)

    def after_sample(self, ctx: StepContext, logits: torch.Tensor, out: StepOutputs) -> None:
        if ctx.drafted is None:
            return

        plan, layout, tokens = ctx.plan, ctx.layout, out.tokens
        drafting = ctx.drafting or []
        stochastic = verify_stochastic(
            plan, layout, logits, tokens, out, ctx.drafted, drafting, self.generator
        )
        if stochastic and out.logprobs is not None:  # rejection replaced some tokens
            lps = torch.log_softmax(logits, dim=-1)
            out.logprobs = lps.gather(1, tokens.unsqueeze(1)).squeeze(1)

    # ---- the draft model ----
    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The draft KV pool: as many blocks as the target's (the same block ids)."""
        m = self.model_cfg
        self.pool = KVPool(
            m.num_layers,
            num_blocks,
            block_size,
            m.num_kv_heads,
            self.kv_head_dim,
            self.dtype,
            self.device,
        )

    def fill_kv(self, fb: ForwardBatch) -> None:
        """Run the draft model over the target's batch `fb`: writes draft KV at every slot
        the target writes (the logits are not needed)."""
        assert self.pool is not None
        self._prepare(fb)
        self.model(fb, self.backend, self.pool)

    def fill_kv_rest(
        self,
        plan: StepPlan,
        layout: StepLayout,
        fb: ForwardBatch | None,
        drafted: DraftOutput | None,
    ) -> None:
        """Draft KV for the step's rows that `propose` did not cover (`drafted`: propose's
        output or None; `fb`: the target's batch of the whole plan when it ran eagerly, read
        only when `drafted` is None)."""
        if drafted is None:
            self.fill_kv(fb if fb is not None else self.slots.forward_batch(layout))
            return
        done = set(drafted.rows)
        keep = [i for i in range(len(plan.rows)) if i not in done]
        if keep:
            rest = StepPlan(
                plan.step_id,
                [plan.rows[i] for i in keep],
                drafts={a: plan.drafts[i] for a, i in enumerate(keep) if i in plan.drafts},
            )
            self.fill_kv(self.slots.forward_batch(layout_plan(rest, self.slots.params)))

    def enable_cuda_graphs(
        self, *, max_batch_size: int, max_blocks_per_seq: int, scratch_block: int, num_slots: int
    ) -> None:
        """Capture decode CUDA graphs of the draft model for `propose`'s one-token steps
        (the target's scratch block is the draft pool's scratch block too)."""
        from radixrt.executor.cuda_graph import DecodeCudaGraphs

        assert self.pool is not None
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.cuda_graphs = DecodeCudaGraphs(
            lambda fb, out: self.model.compute_logits(self.model(fb, self.backend, self.pool), out),
            self.backend,
            max_batch_size=max_batch_size,
            max_blocks_per_seq=max_blocks_per_seq,
            block_size=self.pool.block_size,
            scratch_block=scratch_block,
            device=self.device,
        )

    def _prepare(self, fb: ForwardBatch) -> None:
        self._wait_planned()
        self.backend.prepare(fb)
        self._record_planned()

    def _wait_planned(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()

    def _record_planned(self) -> None:
        if self.device.type == "cuda":
            self._planned = self._planned or torch.cuda.Event()
            self._planned.record()

    def _step_logits(self, step_plan: StepPlan, inputs: torch.Tensor, graph: bool) -> torch.Tensor:
        """Logits [R, V] float32 of one draft step: row r feeds inputs[r] (device)."""
        layout = layout_plan(step_plan, self.slots.params)
        graphs = self.cuda_graphs if graph else None
        if graphs is not None and graphs.can_run(step_plan, layout):
            slots = torch.from_numpy(layout.slots).to(self.device, non_blocking=True)
            self.last_tokens.index_copy_(0, slots, inputs)
            self._wait_planned()
            tables = self.slots.block_tables[layout.slots]
            return graphs.run(layout, tables, self.last_tokens, self._record_planned).float()
        fb = self.slots.forward_batch(layout)
        fb.input_ids = inputs
        self._prepare(fb)
        return self.model.compute_logits(self.model(fb, self.backend, self.pool)).float()

    def propose(
        self, plan: StepPlan, layout: StepLayout, use_cuda_graph: bool = True
    ) -> DraftOutput | None:
        """Drafts for the plan's `device_drafts` rows (None if there are none). Writes
        those rows' draft KV for the whole verify row: positions start .. start + num_drafts
        (n + 1 one-token steps, the last one for the last draft's KV only), so `fill_kv_rest`
        skips them. Steps replay the draft's decode CUDA graphs
        when they were captured (`enable_cuda_graphs`) and `use_cuda_graph`."""
        rows = plan.device_drafts
        if not rows:
            return None
        assert self.pool is not None
        plan_rows = [plan.rows[i] for i in rows]
        row_params = [self.slots.params[r.slot] for r in plan_rows]
        n = [r.num_draft_tokens for r in plan_rows]
        k, vocab, dev = max(n), self.model_cfg.vocab_size, self.device
        assert all(not r.reads_last_sample for r in plan_rows), "drafting rows feed host ids"
        tokens = torch.zeros((len(rows), k + 1), dtype=torch.int64)
        tokens[:, 0] = torch.tensor([r.input_ids[0] for r in plan_rows])
        tokens = tokens.to(dev, non_blocking=True)
        probs = torch.zeros((len(rows), k, vocab), dtype=torch.float32, device=dev)
        greedy = torch.tensor([p.greedy for p in row_params]).to(dev, non_blocking=True)
        for j in range(k + 1):  # step n of a row: its last draft's KV only (no sample)
            active = [a for a in range(len(rows)) if n[a] >= j]
            step_plan = StepPlan(plan.step_id, [_one_token_row(plan_rows[a], j) for a in active])
            act = torch.tensor(active, dtype=torch.int64).to(dev, non_blocking=True)
            logits = self._step_logits(step_plan, tokens[act, j], use_cuda_graph)
            sampled = [b for b, a in enumerate(active) if n[a] > j]
            if not sampled:
                continue
            if len(sampled) < len(active):
                logits = logits[torch.tensor(sampled).to(dev, non_blocking=True)]
                active = [active[b] for b in sampled]
                act = torch.tensor(active, dtype=torch.int64).to(dev, non_blocking=True)
            params = [row_params[a] for a in active]
            q = sampling_probs(logits, params)
            steps = [plan_rows[a].num_output_before + j for a in active]
            noise = row_noise(
                params, steps, (vocab,), "exponential", DRAFT_SALT + j, dev, self.generator
            )
            drawn = torch.where(greedy[act], logits.argmax(dim=-1), (q / noise).argmax(dim=-1))
            tokens[act, j + 1] = drawn
            probs[act, j] = q
        flat = [int(layout.qo_indptr[i]) + 1 + j for i, m in zip(rows, n) for j in range(m)]
        return DraftOutput(
            rows=rows,
            num_drafts=n,
            token_ids=tokens[:, 1:],
            probs=probs,
            flat_index=torch.tensor(flat, dtype=torch.int64).to(dev, non_blocking=True),
        )

    def draft_inputs(self, out: DraftOutput) -> torch.Tensor:
        """The drafts in the order of `out.flat_index` ([sum num_drafts] int64)."""
        k = out.token_ids.shape[1]
        flat = [a * k + j for a, n in enumerate(out.num_drafts) for j in range(n)]
        index = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        return out.token_ids.reshape(-1)[index]  # a gather: no host sync (a mask would sync)


def _one_token_row(r: PlanRow, j: int) -> PlanRow:
    """Draft step j of verify row `r`: one token at position r.start + j, sampled; its id is
    on the device (a "last sample" read there: `_step_logits` writes it)."""
    return PlanRow(
        rid=r.rid,
        slot=r.slot,
        start=r.start + j,
        num_tokens=1,
        input_ids=[],
        reads_last_sample=True,
        sample_offsets=[0],
    )
