"""Tree decoding whose rounds stay on the device, with one host synchronisation per round.

The host path (``eagle.decoding.loop.decode_loop`` with ``EagleDrafter``) reads the pool's scores,
the tree and the accepted path back to the host several times a round; on a GPU each read waits
for the device to drain, and the launches of the next step wait for the read. Here a round keeps
every tensor on the device, in shapes fixed by (top_k, depth, total_tokens), as EAGLE-2's own
implementation does:

1. draft (``DeviceTreeDrafter.draft``): the root's top_k children; then ``depth`` times the top_k
   best frontier nodes run through the drafter in one call (k rows under a tree mask over the
   committed cache and the nodes run before them) and each gets its top_k children. The pool has
   1 + k + depth k^2 nodes; the root and the best total_tokens - 1 are the tree (``select_tree``).
   With a ``GraphedDrafter`` the whole phase is one static function, replayed as one CUDA graph;
2. verify: one target forward over the tree (the static path pads it to its bucket);
3. accept on the device (``greedy_accept``; at temperature > 0 ``drawn_accept`` for drawn
   children, ``sampled_accept`` for the top-k children of ``sampled_tree=False``), then one copy
   to the host: the number of accepted nodes, the next token and the path's tokens;
4. compact the target's cache with one gather and feed the drafter the accepted path.

Drawn children (``TreeConfig.sampled_tree``, the default when sampling) are the host path's:
k draws without replacement (Gumbel-top-k) from the drafter at the temperature times
``draw_temperature_scale``, among its ``draw_support`` most likely tokens, scored by the k
largest log-probabilities (so no node's place depends on what was drawn); the round's Gumbel
noise is drawn from the device generator into a static buffer before the draft phase runs (a
graph replays with new noise), and ``drawn_accept`` is ``recursive_rejection_tree``'s rule on fixed
shapes. Prompt-lookup grafts and static trees (``choices``) belong to the host path;
``total_tokens="auto"`` (a size measured each round) is the host path's too: device rounds run one
fixed tree size (``eagle.engine.host_only``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import torch

from eagle.config import SamplingConfig, TreeConfig
from eagle.decoding.loop import Clock, GenerationResult, check_request, chunk_and_stop, finish
from eagle.decoding.sampling import invert_cdf, logits_to_probs
from eagle.decoding.tree import (drawn_children, grow_pools, kept_parents, kept_pool, pool_depths,
                                 topk_children)
from eagle.runtime.masks import additive_bias
from eagle.errors import EagleError
from eagle.runtime import kv_cache
from eagle.runtime.shapes import MAX_TREE  # noqa: F401 - the most tree tokens a round verifies
from eagle.runtime.target import Target



@dataclasses.dataclass
class DeviceTree:
    """A draft tree on the device: ``tokens`` [T] target ids (root first); ``parents`` [T] long
    (root -1, parents[i] < i); ``scores`` [T] the cumulative draft log-probability of each path
    (root 0); ``depths`` [T] long (root 0); ``ancestors`` [T, T] bool, ancestors[i, j] = j is i or
    an ancestor of i; ``max_depth``: no node is deeper."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    max_depth: int

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``parents`` [T] (root -1, parents[i] < i), no node deeper than ``max_depth`` -> [T, T] bool,
    [i, j] = j is i or an ancestor of i (``max_depth`` steps up, fixed: no data-dependent shape)."""
    index = torch.arange(parents.shape[0], device=parents.device)
    mask = index[:, None] == index[None, :]
    up = parents
    for _ in range(max_depth):
        mask |= index[None, :] == up[:, None]  # a root's -1 matches no column
        up = torch.where(up >= 0, parents[up.clamp(min=0)], up)
    return mask


def select_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depths: torch.Tensor,
                total: int, max_depth: int) -> DeviceTree:
    """The root and the ``total - 1`` best-scoring nodes of a pool, in pool order, re-indexed.

    Pool: ``tokens``/``parents``/``scores``/``depths`` [M], index 0 the root, parents[i] < i, no
    child scoring above its parent. Ties go to the lower index (a stable sort), so a kept node's
    parent, which scores at least as high and comes first, is kept too: the result is a tree."""
    return kept_tree(tokens, parents, scores, depths, kept_pool(scores, total), max_depth)


def kept_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depths: torch.Tensor,
              kept: torch.Tensor, max_depth: int) -> DeviceTree:
    """The pool nodes ``kept`` [n] (``kept_pool``: increasing, root first, closed under parents), re-indexed."""
    new_parents = kept_parents(parents, kept)
    return DeviceTree(tokens[kept], new_parents, scores[kept], depths[kept], ancestor_matrix(new_parents, max_depth),
                      max_depth)


@dataclasses.dataclass
class DeviceAcceptance:
    """``path`` [max_depth + 1] long: the accepted nodes by depth, root first (entries past
    ``count - 1`` are arbitrary); ``count`` [] long: accepted nodes, root included; ``next_token``
    [] long: the target's token after the last accepted node. All on the device."""

    path: torch.Tensor
    count: torch.Tensor
    next_token: torch.Tensor


def row(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a 0-dim device ``index`` without reading it back: Python indexing by a 0-dim
    tensor reads its value to the host (a synchronisation on a GPU)."""
    return x.index_select(0, index.reshape(1))[0]


def deepest_agreeing(tree: DeviceTree, agrees: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``agrees`` [T] bool (the root's entry ignored): whether the target took each node given its
    parent. -> (the deepest node all of whose non-root ancestors-or-self agree [] (the first on a tie),
    the path to it by depth [max_depth + 1], its accepted count [])."""
    index = torch.arange(tree.size, device=agrees.device)
    agrees = agrees | (index == 0)
    reached = ~(tree.ancestors & ~agrees[None, :]).any(-1)  # [T]
    best = torch.where(reached, tree.depths, -1).argmax()
    slots = torch.full((tree.max_depth + 2,), 0, dtype=torch.long, device=agrees.device)
    on_path = row(tree.ancestors, best)
    slots = slots.scatter(0, torch.where(on_path, tree.depths, tree.max_depth + 1), index)  # off-path: a spare slot
    return best, slots[:tree.max_depth + 1], row(tree.depths, best) + 1


@dataclasses.dataclass
class DeviceDraws:
    """What a tree's drawn children were drawn from, on the device: ``rows`` [T] long, the draw row of
    each tree node's children (-1: none drawn below it); ``ids`` [R, S] the target ids each row's
    children were drawn among; ``logprobs`` [R, S] the drafter's log-probabilities there;
    ``temperature`` [] the draw temperature (drawn from softmax(logprobs / temperature)); ``width``:
    the most children a node has (top_k)."""

    rows: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor
    temperature: torch.Tensor
    width: int


def drawn_accept(tree: DeviceTree, probs: torch.Tensor, draws: DeviceDraws, uniform: torch.Tensor) -> DeviceAcceptance:
    """``acceptance.recursive_rejection_tree`` for a tree of drawn children (each node's children
    are its parent's draws without replacement, in draw order) on fixed shapes: ``probs`` [T, V]
    the warped target distribution after each node, ``uniform`` [T + 1] (node i's try, then the
    next token's draw).

    At node v the children are tried in order against r, what the target still owes (p_v at first,
    kept unnormalized with its mass), each with q_j, v's draw distribution without the earlier
    draws: child x is accepted when u q_j(x) mass < r(x); on rejection r <- max(0, r - mass q_j)
    (r itself where that leaves nothing) and x leaves q. A rejected child changes r only on the
    draw support, so every node's state is [T, S]: all nodes run their j-th try at once, ``width``
    tries in all, each assuming the tries before it were rejected (the only way it is reached).
    The walk follows the first accepted child; the next token comes from the last node's r."""
    t, k = tree.size, draws.width
    index = torch.arange(t, device=probs.device)
    rows = draws.rows.clamp(min=0)
    ids = draws.ids[rows]  # [T, S]
    q = torch.softmax(draws.logprobs[rows].double() / draws.temperature.double(), dim=-1)
    full = probs.double()
    mass = full.sum(-1)  # [T]
    r = full.gather(1, ids)
    outside = mass - r.sum(-1)  # what r holds off the support: no rejection changes it
    siblings_before = (tree.parents[:, None] == tree.parents[None, :]) & (index[None, :] < index[:, None])
    place = torch.where(index > 0, tree.parents.clamp(min=0) * k + siblings_before.sum(-1), t * k)
    child_at = torch.full((t * k + 1,), -1, dtype=torch.long, device=probs.device).scatter(0, place, index)
    child_at = child_at[:t * k].reshape(t, k)  # [T, k]: node v's j-th child, -1 past the last
    first = torch.zeros(t, dtype=torch.bool, device=probs.device)
    done = torch.zeros(t, dtype=torch.bool, device=probs.device)
    for j in range(k):
        child = child_at[:, j].clamp(min=0)
        hit = ids == tree.tokens[child][:, None]  # [T, S]
        qx, rx = (q * hit).sum(-1), (r * hit).sum(-1)
        tried = (child_at[:, j] >= 0) & (qx > 0) & ~done  # an underflowed draw is skipped, as if never drawn
        accepted = tried & (uniform[child] * qx * mass < rx)
        first = first | torch.zeros_like(first).scatter(0, child, accepted)
        done = done | accepted
        rejected = (tried & ~accepted)[:, None]
        residual = (r - q * mass[:, None]).clamp(min=0)
        left = outside + residual.sum(-1)
        shrink = rejected[:, 0] & (left > 0)
        r, mass = torch.where(shrink[:, None], residual, r), torch.where(shrink, left, mass)
        q = q.masked_fill(rejected & hit, 0.0)
        q_left = q.sum(-1, keepdim=True)
        q = torch.where(rejected & (q_left > 0), q / q_left.clamp(min=1e-300), q)
    best, path, count = deepest_agreeing(tree, first)
    owed = row(full, best).scatter(0, row(ids, best), row(r, best))
    return DeviceAcceptance(path, count, invert_cdf(owed, uniform[t]))


def greedy_accept(tree: DeviceTree, argmax: torch.Tensor) -> DeviceAcceptance:
    """The longest path whose every token is the target's argmax at its parent, plus the bonus.
    ``argmax`` [T]: the target's greedy token after each node."""
    agrees = tree.tokens == argmax[tree.parents.clamp(min=0)]
    best, path, count = deepest_agreeing(tree, agrees)
    return DeviceAcceptance(path, count, row(argmax, best))


def sampled_accept(tree: DeviceTree, probs: torch.Tensor, uniform: torch.Tensor) -> DeviceAcceptance:
    """Recursive rejection sampling over a tree of deterministic drafts (SpecInfer; EAGLE-2's
    top-k children), exact for any ``probs`` [T, V] (the warped target distribution after each
    node), given that no draft depends on the target's draws. ``uniform`` [T + 1]: node i's draw,
    then the next token's (``drawn_accept``'s arguments: no generator, no host tensor).

    At node v the children are tried in index order; after the earlier siblings x_1..x_{j-1} were
    rejected, what the target still owes is p_v without them, renormalized, so child j is accepted
    with probability p_v(x_j) / (1 - sum_{i<j} p_v(x_i)): every node's chance is known in advance
    and one uniform draw per node decides all of them at once. The walk stops at the first node none
    of whose children was accepted; the next token is drawn from its p without its children."""
    t = tree.size
    index = torch.arange(t, device=probs.device)
    parent = tree.parents.clamp(min=0)
    mass = probs[parent, tree.tokens].double()  # [T] p_parent(x)
    siblings_before = (tree.parents[:, None] == tree.parents[None, :]) & (index[None, :] < index[:, None])
    owed = 1.0 - siblings_before.double() @ mass
    chance = torch.where(owed > 1e-12, mass / owed.clamp(min=1e-12), torch.ones_like(mass)).clamp(max=1.0)
    accepted = (uniform[:t] < chance) & (index > 0)
    first = accepted & ~((siblings_before.double() @ accepted.double()) > 0)  # tried in order: the first acceptance
    best, path, count = deepest_agreeing(tree, first)
    children = torch.zeros(probs.shape[-1], dtype=probs.dtype, device=probs.device).index_add(
        0, tree.tokens, (tree.parents == best).to(probs.dtype))
    owed_probs = row(probs, best) * (children == 0)
    return DeviceAcceptance(path, count, invert_cdf(owed_probs, uniform[t]))


class DeviceTreeDrafter:
    """The feature-level drafter growing EAGLE-2 trees of fixed shape on the device (``draft``),
    fed what the target accepted (``extend``). ``drafter``: the inference copy (``LeanDrafter``,
    or a ``GraphedDrafter`` whose calls replay CUDA graphs); ``top_k``/``depth``/``total`` as in
    ``TreeConfig`` (``total`` an int). ``draw_temperature`` > 0: children drawn at it (the sampling
    temperature times ``draw_temperature_scale``) among the ``draw_support`` most likely draft
    tokens (0: all), as ``EagleDrafter`` draws them; 0: the drafter's top_k."""

    def __init__(self, drafter, target: Target, top_k: int, depth: int, total: int, draw_temperature: float = 0.0,
                 draw_support: int = 0) -> None:
        vocab = drafter.config.draft_vocab_size or drafter.config.vocab_size
        if top_k > vocab:
            raise EagleError(f"tree top_k {top_k} exceeds the drafter's vocabulary ({vocab})")
        self.drafter, self.target, self.top_k, self.depth, self.total = drafter, target, top_k, depth, total
        self.dtype, self.device = drafter.dtype, target.device
        self.draft_ids = drafter.to_target_ids(torch.arange(vocab, device=self.device))  # draft index -> target id
        self.draw_temperature = draw_temperature
        support = max(top_k, draw_support)
        self.support = support if draw_support and support < vocab else vocab  # the S tokens children are drawn among
        self.temperature = torch.tensor(draw_temperature, device=self.device)  # [] made here, outside any capture
        self.cache: kv_cache.StaticCache | None = None  # from ``start`` (a graphed drafter has one)
        self.last_hidden: torch.Tensor | None = None  # the drafter's prediction at the root [H]
        self._layouts: dict[int, torch.Tensor] = {}

    def start(self) -> None:
        self.cache = self.drafter.new_cache()
        self.last_hidden = None

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Feed pairs (f_t, x_{t+1}) for newly committed positions: ``features`` [n, F], ``next_tokens`` [n]."""
        past = kv_cache.cache_length(self.cache)
        n = next_tokens.shape[0]
        pos = torch.arange(past, past + n, device=self.device)[None]
        out = self.drafter(features[None].to(self.dtype), self.target.embed(next_tokens[None]).to(self.dtype), pos,
                           self.cache)
        self.last_hidden = out[0, -1]

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.drafter.draft_logits(hidden, lambda h: self.target.lm_head(h.to(self.target.dtype)))
        return torch.log_softmax(logits.float(), dim=-1)

    def expansions(self, levels: int, committed: int) -> int:
        """Drafter calls for paths of at most ``levels`` drafts: ``levels - 1``, at most ``depth``,
        and no more than the drafter's cache has room for after ``committed`` positions."""
        calls = max(0, min(self.depth, levels - 1))
        capacity = getattr(self.cache, "capacity", None)
        if capacity is not None:  # a static cache: each call writes k rows, padded to their bucket
            from eagle.runtime.cuda_graphs import bucket_for

            padded = bucket_for(self.top_k) or self.top_k
            calls = min(calls, max(0, (capacity - committed - padded) // self.top_k + 1))
        return calls

    def _layout(self, calls: int) -> torch.Tensor:
        """The depths [1 + k + calls k^2] of every pool of ``calls`` drafter calls, made once."""
        layout = self._layouts.get(calls)
        if layout is None:
            layout = self._layouts[calls] = torch.tensor(pool_depths(self.top_k, calls), device=self.device)
        return layout

    @torch.inference_mode()
    def draft(self, root: torch.Tensor, levels: int,
              generator: torch.Generator | None = None) -> tuple[DeviceTree, DeviceDraws | None]:
        """A tree below ``root`` [1] (target id) with paths of at most ``levels`` drafts (at most
        ``depth`` + 1), and what its children were drawn from (None: top-k children); drawn children
        take their noise from ``generator`` (on the device). Leaves the drafter's cache as it found
        it. With a ``GraphedDrafter`` the whole phase (every drafter call, top-k or the draws, and the
        selection) is one static function of the root, the root's prediction, the committed length,
        the draw temperature and the round's uniforms, replayed as one CUDA graph."""
        committed = kv_cache.cache_length(self.cache)
        calls = self.expansions(levels, committed)
        drawing = self.draw_temperature > 0
        noise_shape = (1 + calls * self.top_k, self.support)  # a uniform per drawable token of each expanded node
        runner = getattr(self.drafter, "runner", None)
        if runner is None or self.cache is not runner.cache:
            noise = torch.rand(noise_shape, generator=generator, device=self.device) if drawing else None
            out = self._grow(self.last_hidden, root, calls, self._cached_step(committed), self.temperature, noise)
            kv_cache.roll_back(self.cache, committed)
            return self._unpack(out, drawing)
        from eagle.runtime.shapes import StaticShape, keys_for

        keys_len = keys_for(committed + calls * self.top_k, runner.cache.capacity)

        def make() -> StaticShape:
            inputs = dict(hidden=torch.zeros_like(self.last_hidden), root=torch.zeros_like(root),
                          committed=torch.zeros((), dtype=torch.long, device=self.device),
                          temperature=torch.ones((), device=self.device))
            if drawing:
                inputs["noise"] = torch.zeros(noise_shape, device=self.device)
            step = self._static_step(inputs["committed"], calls, keys_len)
            return StaticShape(inputs, lambda: self._grow(inputs["hidden"], inputs["root"], calls, step,
                                                     inputs["temperature"], inputs.get("noise")))

        def fill(entry: StaticShape) -> None:
            entry.inputs["hidden"].copy_(self.last_hidden)
            entry.inputs["root"].copy_(root)
            entry.inputs["committed"].fill_(committed)
            if drawing:  # this round's uniforms, drawn outside the graph into its static buffer
                entry.inputs["temperature"].copy_(self.temperature)
                entry.inputs["noise"].uniform_(generator=generator)

        # every shape the phase depends on: tree and chain (k, total) share one drafter and its runner
        key = ("draft phase", self.top_k, self.total, calls, keys_len, self.support if drawing else 0)
        return self._unpack(runner.run(key, make, fill), drawing)

    def _unpack(self, out: tuple, drawing: bool) -> tuple[DeviceTree, DeviceDraws | None]:
        """``_grow``'s output (a flat tuple of tensors) -> the tree and, when drawing, its draws."""
        n = len(dataclasses.fields(DeviceTree))
        tree = DeviceTree(*out[:n])
        return tree, DeviceDraws(*out[n:], self.temperature, self.top_k) if drawing else None

    def _cached_step(self, committed: int):
        """A drafter call through the drafter's own forward and cache (grown on the host; ``draft``
        rolls it back)."""
        k, dev = self.top_k, self.device

        def step(d: int, inputs: torch.Tensor, tokens: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
            run = (d - 1) * k
            eye = torch.eye(k, dtype=torch.bool, device=dev)
            allowed = torch.cat([torch.ones(k, committed, dtype=torch.bool, device=dev), earlier[:, :run], eye], 1)
            pos = torch.full((1, k), committed + d - 1, device=dev)
            return self.drafter(inputs[None], self.target.embed(tokens[None]).to(self.dtype), pos, self.cache,
                                additive_bias(allowed, self.dtype))[0]

        return step

    def _static_step(self, committed: torch.Tensor, calls: int, keys_len: int):
        """A drafter call on a ``GraphedDrafter``'s cache with every index computed on the device
        from ``committed`` [] (the cache's committed length): call d writes its k rows at committed
        + (d - 1) k on, at position committed + d - 1, and attends over the first ``keys_len``
        positions: the committed ones, its ancestors among the rows run before, itself."""
        k, dev, graphed = self.top_k, self.device, self.drafter
        rows = torch.arange(k, device=dev)
        columns = torch.arange(keys_len, device=dev)

        def step(d: int, inputs: torch.Tensor, tokens: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
            run = (d - 1) * k
            relative = columns - committed  # [Lk] key position past the committed ones
            slot = relative.clamp(0, calls * k - 1).expand(k, -1)
            ancestor = earlier.gather(1, slot) & ((relative >= 0) & (relative < run))[None, :]
            allowed = (relative < 0)[None, :] | ancestor | (relative[None, :] - run == rows[:, None])
            positions = (committed + d - 1).expand(k)
            return graphed.step(inputs[None], self.target.embed(tokens[None]).to(self.dtype), positions,
                                committed + run + rows, additive_bias(allowed, self.dtype))[0]

        return step

    def _grow(self, hidden: torch.Tensor, root: torch.Tensor, calls: int, step, temperature: torch.Tensor,
              noise: torch.Tensor | None) -> tuple:
        """The draft phase: the root's top-k below ``root`` [1] from the root's prediction ``hidden``
        [H], then ``calls`` expansions, each ``step(d, inputs [k, H], tokens [k], earlier [k, calls k])``
        -> the frontier's predictions [k, H] (``earlier``: which rows of earlier calls are each
        frontier node's ancestors); then the selection. With ``noise`` [1 + calls k, S] (uniforms)
        the children are drawn at ``temperature`` [] (``drawn_children``; row 0 the root's, row
        1 + (d - 1) k + f the f-th frontier node's of call d). -> the tree's fields in order, the tensors
        themselves (a static function's output stays in the graph's memory), then when drawing the
        draws' rows [T], ids [R, S] and log-probs [R, S] (``DeviceDraws``)."""
        k, dev = self.top_k, self.device
        depths = self._layout(calls)
        supports, support_lps = [], []

        def children(parent_scores: torch.Tensor, logprobs: torch.Tensor, row: int) -> tuple[torch.Tensor, ...]:
            if noise is None:
                return topk_children(parent_scores, logprobs, k)
            uniform = noise[row:row + logprobs.shape[1]]
            picks, child_scores, among, among_lp = drawn_children(parent_scores[0], logprobs[0], k, temperature,
                                                                  self.support, uniform)
            supports.append(among)
            support_lps.append(among_lp)
            return picks[None], child_scores[None]

        def one(d: int, inputs: torch.Tensor, tokens: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
            return step(d, inputs[0], tokens[0], earlier[0])[None]

        tokens, parents, pool_scores, frontiers = grow_pools(hidden[None], root, k, calls, self._logprobs, children,
                                                             one, self.draft_ids)
        tokens, parents, pool_scores = tokens[0].long(), parents[0], pool_scores[0]
        size = pool_scores.shape[0]
        kept = kept_pool(pool_scores, min(self.total, size))
        tree = kept_tree(tokens, parents, pool_scores, depths, kept, calls + 1)
        fields = tuple(getattr(tree, f.name) for f in dataclasses.fields(tree))  # not astuple: it deep-copies
        if noise is None:
            return fields
        # the pool index of each draw row: the root's, then each call's frontier
        expanded = torch.cat([torch.zeros(1, dtype=torch.long, device=dev)] + [f[0] for f in frontiers])
        row_of = torch.full((size,), -1, dtype=torch.long, device=dev).scatter(
            0, expanded, torch.arange(expanded.shape[0], device=dev))
        return fields + (row_of[kept], self.draft_ids[torch.cat(supports)], torch.cat(support_lps))


def device_rounds_apply(tree: TreeConfig, sampling: SamplingConfig) -> bool:
    """Whether a tree of ``tree`` at ``sampling`` can run in device rounds (else the host path runs
    it): any dynamic tree, its children drawn or not."""
    return tree.choices is None


def draw_temperature(tree: TreeConfig, sampling: SamplingConfig) -> float:
    """What a dynamic tree's children are drawn at: the sampling temperature times
    ``draw_temperature_scale`` when sampling with ``sampled_tree``, else 0 (the drafter's top_k)."""
    return 0.0 if sampling.greedy or not tree.sampled_tree else sampling.temperature * tree.draw_temperature_scale


@torch.inference_mode()
def device_decode_loop(target: Target, drafter: DeviceTreeDrafter, prompt_ids: list[int], max_new_tokens: int,
                       sampling: SamplingConfig, generator: torch.Generator,
                       method: str = "") -> Iterator[list[int] | GenerationResult]:
    """``decode_loop``'s contract (yield each chunk of accepted tokens, then the ``GenerationResult``)
    with device rounds: one host read per round."""
    check_request(target, prompt_ids, max_new_tokens)
    device, start = target.device, time.perf_counter()
    if not sampling.greedy and generator.device != device:  # draws on the device, seeded from the caller's generator
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        generator = torch.Generator(device).manual_seed(seed)
    ids, new, accept_lengths, forwards, stop = list(prompt_ids), [], [], 0, ""
    aux = tuple(drafter.drafter.config.aux_layers)
    cache = target.new_cache()
    drafter.start()
    prompt = torch.tensor(ids, device=device)
    if len(ids) > 1:  # prefill all but the last token, which roots the first tree
        out = target.forward(prompt[None, :-1], torch.arange(len(ids) - 1, device=device)[None], cache,
                             logits_from=len(ids) - 1, aux_layers=aux)
        drafter.extend(out.features[0], prompt[1:])
    root = prompt[-1:]
    clock = Clock(device, events=True)  # synchronizes CUDA once: the prefill's own time
    prefill_s = time.perf_counter() - start
    while not stop:
        past = len(ids) - 1
        room = min(max_new_tokens - len(new), target.max_context - len(ids))
        # 1. draft a tree of fixed shape below the root
        if drafter.last_hidden is None:  # a one-token prompt: nothing to draft from yet
            tree, draws = select_tree(root, torch.tensor([-1], device=device), torch.zeros(1, device=device),
                                      torch.zeros(1, dtype=torch.long, device=device), 1, 0), None
        else:
            tree, draws = drafter.draft(root, max(1, min(drafter.depth + 1, room - 1)), generator)
        clock.lap("draft")
        # 2. verify it in one target forward
        allowed = torch.cat([torch.ones(tree.size, past, dtype=torch.bool, device=device), tree.ancestors], 1)
        bias = additive_bias(allowed, target.dtype) if tree.size > 1 else None
        out = target.forward(tree.tokens[None], (past + tree.depths)[None], cache, bias,
                             logits_from=tree.size if sampling.greedy else 0, aux_layers=aux)
        forwards += 1
        clock.lap("verify")
        # 3. accept on the device; one read brings the count, the next token and the path's tokens
        if sampling.greedy:
            acc = greedy_accept(tree, target.greedy_tokens(out.hidden[0]))
        else:  # a uniform per node and one for the next token, from the device generator
            uniform = torch.rand(tree.size + 1, generator=generator, dtype=torch.float64, device=device)
            probs = logits_to_probs(out.logits[0], sampling)
            acc = sampled_accept(tree, probs, uniform) if draws is None else drawn_accept(tree, probs, draws, uniform)
        head = torch.stack([acc.count, acc.next_token])
        read = torch.cat([head, tree.tokens[acc.path]]).tolist()
        count, next_token, path_tokens = read[0], read[1], read[2:]
        clock.lap("accept")
        # 4. compact the target's cache to the accepted path; feed the drafter
        nodes = acc.path[:count]
        kv_cache.compact(cache, past, past + nodes)
        chunk, stop = chunk_and_stop(path_tokens[1:count] + [next_token], target, room, len(new), max_new_tokens)
        ids.extend(chunk)
        if not stop:
            root = acc.next_token.reshape(1)
            drafter.extend(out.features[0, nodes], torch.cat([tree.tokens[nodes[1:]], root]))
        clock.lap("cache")
        new.extend(chunk)
        accept_lengths.append(len(chunk))
        yield chunk
        clock.lap("other")
    yield finish(target, clock, new, accept_lengths, forwards, start, len(prompt_ids), stop, prefill_s, method)
