"""The scheduler's side of draft-model speculation: how many drafts a decode row gets.

The draft model itself runs in the runner (`radixrt.executor.draft`): the scheduler stays
torch-free, reserves KV for k + 1 tokens as for any proposer and lists the row of k drafts in
`StepPlan.device_drafts` (the placeholders are not sent); the runner runs the draft model k steps
over the row on the device, writes the drafts into the verify row's inputs and verifies them
in the same step (no host round trip for the drafts).
"""

from __future__ import annotations

from collections.abc import Sequence

from radixrt.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.speculative.base import Proposer

PLACEHOLDER = 0  # the input id planned for a draft the runner writes


class DraftModelProposer(Proposer):
    """Drafts on the device: a row may always draft (`may_propose_next`: True)."""

    drafts_on_device = True

    def propose(
        self, tokens: Sequence[int], max_drafts: int, namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> list[int]:
        """`max_drafts` placeholders: the draft model always drafts the full k."""
        return [PLACEHOLDER] * max_drafts
