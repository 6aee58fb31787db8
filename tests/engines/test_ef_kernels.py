"""The error-feedback kernels as the built extension runs them (the C tests
run them at -O1; this build is -O3 with the AVX2 clones where the CPU has
AVX2), single-process:
  - the tile DCT gives the bits of products summed in order with one
    rounding per multiply and per add, which NumPy's float32 elementwise
    operations compute, so every build and every rank gets the same bits;
  - one rank's payload decodes (sparse mean over one rank) to exactly what
    compress took out of the error-feedback buffer;
  - the glue refuses buffers that do not fit, naming them."""

import numpy as np
import pytest
import torch

from mpidp import _C

pytestmark = pytest.mark.serial


def ordered_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in float32, each output summed from 0 in order of the inner index."""
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    for i in range(a.shape[1]):
        acc = acc + a[:, i:i + 1] * b[i:i + 1, :]
    return acc


def basis(side: int) -> torch.Tensor:
    out = torch.empty(side * side)
    _C.ef_dct_basis(out, side)
    return out


@pytest.mark.parametrize("rows, cols", [(64, 64), (8, 64), (5, 48), (64, 7), (1, 64)])
def test_dct_gives_the_ordered_products_bits(rows, cols):
    gen = torch.Generator().manual_seed(rows * 100 + cols)
    tiles = torch.randn(3, rows, cols, generator=gen)
    fr, fc = basis(rows), basis(cols)
    got = tiles.clone()
    _C.ef_dct_tiles(got, rows, cols, fr, fc, False)
    r, c = fr.view(rows, rows).numpy(), fc.view(cols, cols).numpy()
    for t in range(3):
        want = ordered_product(r.T, ordered_product(tiles[t].numpy(), c))
        assert np.array_equal(got[t].numpy(), want)
    back = got.clone()
    _C.ef_dct_tiles(back, rows, cols, fr, fc, True)
    for t in range(3):
        want = ordered_product(r, ordered_product(got[t].numpy(), c.T))
        assert np.array_equal(back[t].numpy(), want)
    torch.testing.assert_close(back, tiles, rtol=0, atol=2e-5)


@pytest.mark.parametrize("bins", [0, 4, 16])
def test_one_rank_decodes_what_compress_took_out(bins):
    gen = torch.Generator().manual_seed(bins)
    e, delta = torch.randn(96, 40, generator=gen), torch.randn(96, 40, generator=gen)
    updated = 0.9 * e + 0.5 * delta
    tiling = _C.ef_tiling((96, 40), 64)
    assert tiling == (96, 40, 48, 40)
    k = 20                         # 2 tiles of 48 x 40
    size = _C.ef_payload_bytes(2, 48 * 40, k, bins)
    bucket = torch.zeros(size + 7, dtype=torch.uint8)
    _C.ef_compress(e, delta, tiling, 0.9, 0.5, k, bins, 6.0, bucket, 7)
    sent = torch.empty(96, 40)
    _C.ef_sparse_mean(sent, bucket, 7, size, 1, tiling, k, bins, False)
    torch.testing.assert_close(e + sent, updated, rtol=0, atol=1e-6)
    assert int((sent != 0).sum()) == 2 * k


def test_buffers_that_do_not_fit_are_refused():
    tiling = _C.ef_tiling((8, 8), 64)
    e = torch.zeros(8, 8)
    size = _C.ef_payload_bytes(1, 64, 4, 4)
    with pytest.raises(ValueError, match="bucket: 1 payload"):
        _C.ef_compress(e, None, tiling, 1.0, 1.0, 4, 4, 6.0, torch.zeros(size, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match="bucket: expected a uint8 tensor"):
        _C.ef_compress(e, None, tiling, 1.0, 1.0, 4, 4, 6.0, torch.zeros(size), 0)
    with pytest.raises(ValueError, match="e: expected 64 elements"):
        _C.ef_compress(torch.zeros(7), None, tiling, 1.0, 1.0, 4, 4, 6.0,
                       torch.zeros(size, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="gathered: 3 payload"):
        _C.ef_sparse_mean(e, torch.zeros(3 * size - 1, dtype=torch.uint8), 0, size, 3, tiling, 4, 4,
                          False)
    with pytest.raises(ValueError, match="k must be 1 .. 64"):
        _C.ef_compress(e, None, tiling, 1.0, 1.0, 65, 0, 6.0,
                       torch.zeros(65 * 6, dtype=torch.uint8), 0)
