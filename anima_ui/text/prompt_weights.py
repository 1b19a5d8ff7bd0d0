"""ComfyUI's prompt-weight syntax: `(text)` multiplies the weight by 1.1 per nesting level, `(text:1.3)`
sets it, `\\(` and `\\)` are literal parentheses. A prompt without parentheses is one segment of weight 1.

The result is the list of (text, weight) segments in order; each is tokenized on its own (as ComfyUI does),
so parentheses change the tokens even where the weight stays 1. Unlike ComfyUI, nesting and explicit weights are
bounded (anima_ui.limits): the parse is linear in the prompt, and a weight is a finite number of sane size."""

from anima_ui.limits import MAX_PROMPT_NESTING, check_prompt_nesting, check_prompt_weight

# Placeholders for escaped parentheses while the groups are split (ComfyUI uses the same two).
_ESCAPED_CLOSE = "\0\1"
_ESCAPED_OPEN = "\0\2"


def parse_prompt_weights(prompt: str) -> list[tuple[str, float]]:
    escaped = prompt.replace("\\)", _ESCAPED_CLOSE).replace("\\(", _ESCAPED_OPEN)
    return [(_unescape(text), weight) for text, weight in _weighted_segments(escaped, 1.0, 0)]


def _weighted_segments(text: str, weight: float, depth: int) -> list[tuple[str, float]]:
    """`depth`: how many groups enclose `text`. Each level copies its groups once, so with the nesting bounded the
    whole parse is linear."""
    segments = []
    for group in _top_level_groups(text):
        if len(group) >= 2 and group[0] == "(" and group[-1] == ")":
            if depth == MAX_PROMPT_NESTING:
                check_prompt_nesting(depth + _deepest(group))
            inner, inner_weight = group[1:-1], weight * 1.1
            colon = inner.rfind(":")
            explicit = _number(inner[colon + 1 :]) if colon > 0 else None
            if explicit is not None:  # else the colon is text and the 1.1 factor stays
                inner, inner_weight = inner[:colon], check_prompt_weight(_unescape(group), explicit)
            segments += _weighted_segments(inner, inner_weight, depth + 1)
        else:
            segments.append((group, weight))
    return segments


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _deepest(group: str) -> int:
    """How deep the parentheses of a balanced group nest (1 for `(x)`)."""
    depth = deepest = 0
    for char in group:
        depth += (char == "(") - (char == ")")
        deepest = max(deepest, depth)
    return deepest


def _top_level_groups(text: str) -> list[str]:
    """Split into plain runs and parenthesised groups at nesting depth 0. Unbalanced parentheses stay
    text (a stray `)` makes the depth negative, and nothing closes at depth 0 until it is balanced)."""
    groups, current, depth = [], "", 0
    for char in text:
        if char == "(":
            if depth == 0 and current:
                groups.append(current)
                current = ""
            current += char
            depth += 1
        elif char == ")":
            depth -= 1
            current += char
            if depth == 0:
                groups.append(current)
                current = ""
        else:
            current += char
    if current:
        groups.append(current)
    return groups


def _unescape(text: str) -> str:
    return text.replace(_ESCAPED_CLOSE, ")").replace(_ESCAPED_OPEN, "(")
