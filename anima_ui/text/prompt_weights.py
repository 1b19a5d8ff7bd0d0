"""ComfyUI's prompt-weight syntax: `(text)` multiplies the weight by 1.1 per nesting level, `(text:1.3)`
sets it, `\\(` and `\\)` are literal parentheses. A prompt without parentheses is one segment of weight 1.

The result is the list of (text, weight) segments in order; each is tokenized on its own (as ComfyUI does),
so parentheses change the tokens even where the weight stays 1."""

# Placeholders for escaped parentheses while the groups are split (ComfyUI uses the same two).
_ESCAPED_CLOSE = "\0\1"
_ESCAPED_OPEN = "\0\2"


def parse_prompt_weights(prompt: str) -> list[tuple[str, float]]:
    escaped = prompt.replace("\\)", _ESCAPED_CLOSE).replace("\\(", _ESCAPED_OPEN)
    return [(_unescape(text), weight) for text, weight in _weighted_segments(escaped, 1.0)]


def _weighted_segments(text: str, weight: float) -> list[tuple[str, float]]:
    segments = []
    for group in _top_level_groups(text):
        if len(group) >= 2 and group[0] == "(" and group[-1] == ")":
            inner, inner_weight = group[1:-1], weight * 1.1
            colon = inner.rfind(":")
            if colon > 0:
                try:
                    inner, inner_weight = inner[:colon], float(inner[colon + 1 :])
                except ValueError:
                    pass  # not a number after the colon: the colon is text and the 1.1 factor stays
            segments += _weighted_segments(inner, inner_weight)
        else:
            segments.append((group, weight))
    return segments


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
