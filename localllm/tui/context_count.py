"""How many tokens of context a chat uses, and what still fits: the counts behind the status
bar's gauge, the check before a message is sent and the budgets of "make room".

``ContextCount`` is a mixin of the chat pane: it reads the pane's conversation (``turns``,
``context_start``, ``reply``, ``system_prompt``) and writes only its own caches. Textual-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localllm.tui.backend import chat_tokens, estimate_tokens
from localllm.tui.conversation import ChatHost, Reply, Turn

if TYPE_CHECKING:
    from localllm.tokenizer import Message as ChatMessage, Tokenizer


def reply_reserve(limit: int, max_tokens: int | None) -> int:
    """Room a reply needs at the least: its max_tokens, capped at an eighth of the context."""
    return max(1, min(int(max_tokens or limit), max(16, limit // 8)))


class ContextCount:
    """A message's "tokens" is what it adds to the prompt, its template framing included: a
    reply's are its output ids; a user message's are the prompt minus all before it, from
    the tokenizer at send when the engine is local, and from the engine's (or a server's
    usage) prompt count when its reply ends. So the gauge is the sum of the counts shown.
    meta "estimated" marks a guess (a server that sent no usage); "with_system" a first
    message whose count holds the system prompt (a server counts them as one prompt)."""

    host: ChatHost
    system_prompt: str
    turns: list[Turn]
    context_start: int  # turns[:context_start] stay on screen but are not sent (dropped to make room)
    reply: Reply | None
    # the caches, written only here: the last chat_tokens call, and message text -> budget guess
    _rendered: tuple[tuple[tuple[str, str, str], ...], int | None] | None = None
    _estimates: dict[str, int] | None = None

    @property
    def dropped_until(self) -> int | None:
        """The history id of the last turn not sent; None when all are."""
        return self.turns[self.context_start - 1].message_id if self.context_start else None

    def prompt_messages(self, upto: int | None = None) -> list[ChatMessage]:
        """What the model is sent: the system prompt, then the turns in context before ``upto``."""
        msgs: list[ChatMessage] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        # a reply's reasoning goes along as reasoning_content: the template decides whether it is
        # rendered (Qwen3's and gpt-oss's drop it from past turns; one that does not read it, too)
        msgs += [{"role": t.role, "content": t.content, **({"reasoning_content": t.reasoning} if t.reasoning else {})}
                 for t in self.turns[self.context_start:upto] if t.role in ("user", "assistant")]
        return msgs

    def _tokenizer(self) -> Tokenizer | None:
        engine = self.host.engine
        return engine.tokenizer if engine is not None else None

    def context_used(self) -> int:
        return self.context()[0]

    def context(self, upto: int | None = None) -> tuple[int, bool]:
        """(tokens, estimated) of what the model is sent before turns[upto] (all turns: the
        next prompt). Exact from the engine's count at the last reply still valid, plus the
        counts of what came after it; without such a reply, from the tokenizer when the engine
        is local. Cheap enough for the status bar's repaints: the tokenizer runs only when the
        chat changed."""
        upto = len(self.turns) if upto is None else upto
        start = self.context_start
        for i in range(upto - 1, self.context_start - 1, -1):
            figures = self._reply_figures(self.turns[i])
            if figures is not None:
                used, estimated = figures
                start = i + 1
                break
        else:
            tokenizer = self._tokenizer()
            streaming = self.reply is not None and any(t is self.reply.turn for t in self.turns[start:upto])
            if tokenizer is not None and not streaming:
                exact = self._render_count(tokenizer, upto)
                if exact is not None:
                    return exact, False
            used, estimated = self._system_tokens(start, upto)
        for t in self.turns[start:upto]:
            n, guess = self._tokens(t)
            used += n
            estimated = estimated or guess
        return used, estimated

    def _reply_figures(self, t: Turn) -> tuple[int, bool] | None:
        """The context at the end of reply ``t`` as the engine counted it; None if unknown or
        no longer valid (the chat dropped other turns since)."""
        if t.role != "assistant":
            return None
        reply = self.reply
        if reply is not None and t is reply.turn:
            if not reply.prompt_tokens:  # not yet known (or a server: only at the end)
                return None
            return reply.prompt_tokens - reply.prefix_tokens + reply.num_tokens, False
        meta = t.meta
        if "prompt_tokens" in meta and meta.get("sent_after") == self.dropped_until:
            return int(meta["prompt_tokens"]) + int(meta.get("tokens", 0)), bool(meta.get("estimated"))
        return None

    def _render_count(self, tokenizer: Tokenizer, upto: int) -> int | None:
        """The exact tokens of the chat before turns[upto]: with the generation prompt when a
        user message ends it (then it is the prompt the engine would get)."""
        msgs = self.prompt_messages(upto)
        # str hashes are cached: cheap. The reasoning too: a template may render the current turn's
        key = tuple((m["role"], m["content"], m.get("reasoning_content", "")) for m in msgs)
        if self._rendered is None or self._rendered[0] != key:
            gen = bool(msgs) and msgs[-1]["role"] == "user"
            self._rendered = key, chat_tokens(tokenizer, msgs, gen)
        return self._rendered[1]

    def _system_tokens(self, start: int, upto: int) -> tuple[int, bool]:
        if not self.system_prompt.strip():
            return 0, False
        if start < upto and self.turns[start].meta.get("with_system"):
            return 0, False
        tokenizer = self._tokenizer()
        if tokenizer is not None:
            n = chat_tokens(tokenizer, [{"role": "system", "content": self.system_prompt}], False)
            if n is not None:
                return n, False
        return estimate_tokens(self.system_prompt), True

    def _tokens(self, t: Turn) -> tuple[int, bool]:
        if self.reply is not None and t is self.reply.turn:
            # a server's stream is counted in chunks until its usage arrives
            return self.reply.num_tokens, self._tokenizer() is None
        if "tokens" in t.meta:
            return int(t.meta["tokens"]), bool(t.meta.get("estimated"))
        return estimate_tokens(t.content), True

    def _new_message_tokens(self, text: str, upto: int | None = None) -> tuple[int, bool]:
        """What ``text`` adds to the prompt as the user message after turns[:upto]."""
        tokenizer = self._tokenizer()
        if tokenizer is not None:
            total = chat_tokens(tokenizer, [*self.prompt_messages(upto), {"role": "user", "content": text}], True)
            if total is not None:
                before, guess = self.context(upto)
                return max(1, total - before), guess
        return estimate_tokens(text), True

    def _counted_prompt(self, reply: Reply) -> tuple[int, dict[str, Any]] | None:
        """The index and new meta of the user message a reply answers, its count made exact
        from the prompt's count the engine (or a server's usage) gave: the prompt minus all
        before the message. None when there is nothing to change."""
        index = next((i for i, t in enumerate(self.turns) if t is reply.turn), -1) - 1
        if reply.prefix or not reply.prompt_tokens or index < self.context_start or self.turns[index].role != "user":
            return None
        if index == self.context_start and self._tokenizer() is None:
            before, guess, with_system = 0, False, bool(self.system_prompt.strip())
        else:
            (before, guess), with_system = self.context(index), False
        user = self.turns[index]
        meta = {k: v for k, v in user.meta.items() if k not in ("estimated", "with_system")}
        meta["tokens"] = max(1, reply.prompt_tokens - before)
        if guess:
            meta["estimated"] = True
        if with_system:
            meta["with_system"] = True
        return None if meta == user.meta else (index, meta)

    def system_prompt_tokens(self) -> int | None:
        """The system prompt's own count, where the engine is local (a server counts it with
        the first message); None without a tokenizer or a system prompt."""
        tokenizer = self._tokenizer()
        return (chat_tokens(tokenizer, [{"role": "system", "content": self.system_prompt}], False)
                if tokenizer is not None and self.system_prompt.strip() else None)

    def _estimate(self, text: str) -> int:
        """A budget for summaries: the tokens of ``text`` plus a message's framing."""
        if self._estimates is None:
            self._estimates = {}
        cached = self._estimates.get(text)
        if cached is None:
            tokenizer = self._tokenizer()
            cached = self._estimates[text] = (len(tokenizer.encode(text, add_special_tokens=False)) + 8
                                              if tokenizer is not None else estimate_tokens(text))
        return cached

    def context_limit(self) -> int | None:
        engine = self.host.engine
        return engine.max_model_len if engine is not None else None

    def _keep_from(self, budget: int) -> int:
        """The first turn of the newest turns that fit in ``budget`` tokens, starting at a user
        message; len(turns) when not even the last one fits."""
        total, start = 0, len(self.turns)
        for i in range(len(self.turns) - 1, self.context_start - 1, -1):
            total += self._tokens(self.turns[i])[0]
            if total > budget:
                break
            if self.turns[i].role == "user":
                start = i
        return start

    def _transcript(self, keep: int, budget: int) -> str:
        """The newest turns from ``keep`` on as "User: …" lines, within ``budget`` tokens; a
        turn too long for what is left keeps its end."""
        parts: list[str] = []
        left = budget
        for t in reversed(self.turns[keep:] or self.turns[-2:]):
            if t.role not in ("user", "assistant"):
                continue
            line = f"{'User' if t.role == 'user' else 'Assistant'}: {t.content}"
            cost = self._estimate(line)
            if cost > left:
                if left > 16:  # a tail worth having; 3 characters a token is the generous guess
                    parts.append("…" + line[-left * 3:])
                break
            parts.append(line)
            left -= cost
        return "\n\n".join(reversed(parts))
