"""Tile plans for decoding a latent in pieces (no torch).

`decode_tiled` reproduces stable-diffusion.cpp's `sd_tiling_calc_tiles` / `process_tiles_2d` /
`sd_tensor_merge_2d`: latent tiles decoded independently and summed with smootherstep weights. Each
tile's mid-block attention sees only its tile, so the result differs from the untiled decode.
"""

from dataclasses import dataclass

import numpy as np

from anima_ui.errors import Cancelled, UserError
from anima_ui.vae.latent import SCALE


@dataclass(frozen=True)
class TileAxis:
    count: int
    overlap_factor: float


def tile_axis(length: int, tile: int, overlap_factor: float) -> TileAxis:
    """sd.cpp `sd_tiling_calc_tiles` (non-circular): how many tiles along one latent axis, and the
    overlap they end up with."""
    tile_overlap = int(tile * overlap_factor)
    step = tile - tile_overlap
    count = (length - tile_overlap) // step
    overshoot = ((count + 1) * step + tile_overlap) % length
    if overshoot != step and overshoot <= count * (tile // 2 - tile_overlap):
        count += 1  # room for one more tile without the overlap exceeding 0.5
    if count <= 2:
        if length <= tile:
            return TileAxis(1, 0.0)
        return TileAxis(2, float(np.float32(2 * tile - length) / np.float32(tile)))
    return TileAxis(count, float(np.float32(tile * count - length) / np.float32(tile * (count - 1))))


def tile_size(requested: int, length: int) -> int:
    """sd.cpp `VAE::get_tile_sizes`: at least 4 latent pixels, at most the latent size."""
    return max(min(requested if requested >= 4 else 32, length), 4)


def _smootherstep(t: np.ndarray) -> np.ndarray:
    return t * t * t * (t * (6.0 * t - 15.0) + 10.0)


def _ramp(size: int, skip: int, overlap: int, has_before: bool, has_after: bool) -> np.ndarray:
    """Blend weight along one axis of an output tile, as in sd.cpp `sd_tensor_merge_2d`."""
    i = np.arange(size, dtype=np.float32)
    f = np.ones(size, dtype=np.float32)
    if has_before:
        f = np.minimum(f, (i - skip) / np.float32(overlap))
    if has_after:
        f = np.minimum(f, (size - i) / np.float32(overlap))
    return _smootherstep(np.minimum(f, 1.0))


def _tile_origins(length: int, tile: int, step: int) -> list[tuple[int, int]]:
    """(origin, skip) per tile along one axis: the last tile is moved back to end at the border and its
    first `skip` output rows, already covered, are not accumulated again (sd.cpp `process_tiles_2d`)."""
    origins, pos = [], 0
    while pos < length:
        if pos + tile >= length:
            origins.append((length - tile, pos - (length - tile)))
            break
        origins.append((pos, 0))
        pos += step
    return origins


def decode_tiled(decode, latent: np.ndarray, tile: int = 32, overlap: float = 0.5, cancel=None) -> np.ndarray:
    """Decode a latent [1,16,h,w] tile by tile with `decode` ([1,16,th,tw] -> [1,3,8th,8tw], unclamped) and
    blend exactly like sd.cpp's tiled VAE decode. Returns [1,3,8h,8w] (not clamped: clamp after blending).
    Once `cancel` (a threading.Event) is set, Cancelled is raised before the next tile (Stop in the final decode)."""
    _, _, h, w = latent.shape
    overlap = min(max(overlap, 0.0), 0.5)
    tile_x, tile_y = tile_size(tile, w), tile_size(tile, h)
    axis_x, axis_y = tile_axis(w, tile_x, overlap), tile_axis(h, tile_y, overlap)
    # float32 products, truncated, as in C
    overlap_x = int(np.float32(tile_x) * np.float32(axis_x.overlap_factor))
    overlap_y = int(np.float32(tile_y) * np.float32(axis_y.overlap_factor))
    out = np.zeros((1, 3, h * SCALE, w * SCALE), dtype=np.float32)
    for y, skip_y in _tile_origins(h, tile_y, tile_y - overlap_y):
        for x, skip_x in _tile_origins(w, tile_x, tile_x - overlap_x):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            pixels = decode(np.ascontiguousarray(latent[:, :, y:y + tile_y, x:x + tile_x]))
            oy, ox, th, tw = y * SCALE, x * SCALE, tile_y * SCALE, tile_x * SCALE
            sy, sx = skip_y * SCALE, skip_x * SCALE
            if overlap_x == 0 and overlap_y == 0:
                out[:, :, oy + sy:oy + th, ox + sx:ox + tw] = pixels[:, :, sy:, sx:]
                continue
            weight_y = _ramp(th, sy, overlap_y * SCALE, overlap_y > 0 and oy > 0, overlap_y > 0 and oy < h * SCALE - th)
            weight_x = _ramp(tw, sx, overlap_x * SCALE, overlap_x > 0 and ox > 0, overlap_x > 0 and ox < w * SCALE - tw)
            weight = weight_y[sy:, None] * weight_x[None, sx:]
            out[:, :, oy + sy:oy + th, ox + sx:ox + tw] += pixels[:, :, sy:, sx:] * weight
    return out


# ---------------------------------------------------------------- exact tiles: trunk untiled, up path with a halo

# The up path (everything after the mid block) is local: its 3x3 convs reach 6 latent px at the latent
# resolution, 3 + 0.5 at 2x, 1.5 + 0.25 at 4x and 0.75 + 0.125 + 0.125 at 8x: 12.25 latent px in all.
# A tile with 13 latent px of real neighbours on each inner side computes its centre exactly as the
# untiled decode does; only the mid-block attention (in the trunk) needs the whole latent.
HALO = 13


@dataclass(frozen=True)
class HaloTile:
    y: int  # window origin, latent px
    x: int
    keep: tuple[int, int, int, int]  # (y0, y1, x0, x1): the latent px of the image this tile supplies


@dataclass(frozen=True)
class HaloPlan:
    height: int  # latent px
    width: int
    window: tuple[int, int]  # (height, width) of every tile's window, latent px
    halo: int
    tiles: tuple[HaloTile, ...]


def _halo_axis(length: int, count: int, halo: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Window size and (origin, keep start, keep end) per tile along one axis: `count` windows of one
    size, the first at 0, the last ending at `length`, each keeping what lies >= `halo` from its inner
    edges."""
    if count < 1:
        raise UserError(f"a halo tile grid needs at least one tile per axis, not {count}")
    size = min(length, -(-(length + 2 * halo * (count - 1)) // count))
    if count == 1 or size == length:
        return length, [(0, 0, length)]
    origins = [round(i * (length - size) / (count - 1)) for i in range(count)]
    keeps = [0] + [origin + halo for origin in origins[1:]] + [length]
    axis = [(origins[i], keeps[i], keeps[i + 1]) for i in range(count)]
    for origin, start, end in axis:  # each kept span lies in its window, `halo` away from inner edges
        assert (origin == 0 or start >= origin + halo) and \
               (origin + size == length or end <= origin + size - halo), (length, count, halo, axis)
    return size, axis


def halo_plan(height: int, width: int, grid: tuple[int, int] = (2, 2), halo: int = HALO) -> HaloPlan:
    """Tiles of one window size over a height x width latent (feature map), `grid` = tiles per axis; a
    grid the latent is too small for collapses to fewer (down to one untiled window)."""
    size_y, axis_y = _halo_axis(height, grid[0], halo)
    size_x, axis_x = _halo_axis(width, grid[1], halo)
    tiles = tuple(HaloTile(y, x, (y0, y1, x0, x1)) for y, y0, y1 in axis_y for x, x0, x1 in axis_x)
    return HaloPlan(height, width, (size_y, size_x), halo, tiles)


def cut_windows(features: np.ndarray, plan: HaloPlan) -> np.ndarray:
    """The tiles' windows of a feature map [1,C,h,w], stacked as a batch [tiles,C,wh,ww]."""
    wh, ww = plan.window
    return np.concatenate([features[:, :, t.y:t.y + wh, t.x:t.x + ww] for t in plan.tiles], axis=0)


def assemble(images: np.ndarray, plan: HaloPlan) -> np.ndarray:
    """The decoded windows [tiles,3,8wh,8ww] -> the image [1,3,8h,8w], each tile supplying its kept part."""
    out = np.empty((1, images.shape[1], plan.height * SCALE, plan.width * SCALE), images.dtype)
    for image, t in zip(images, plan.tiles):
        y0, y1, x0, x1 = t.keep
        out[0, :, y0 * SCALE:y1 * SCALE, x0 * SCALE:x1 * SCALE] = \
            image[:, (y0 - t.y) * SCALE:(y1 - t.y) * SCALE, (x0 - t.x) * SCALE:(x1 - t.x) * SCALE]
    return out
