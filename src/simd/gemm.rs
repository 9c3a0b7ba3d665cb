//! A safe face for the `gemm` crate's f32 matrix product (raw pointers and
//! strides), used by the many-token path of the quantized linear layer.

/// `c[i, j] = Σ_p a[i, p] · b[j, p]` for row-major `a` (`m x k`), `b`
/// (`n x k`) and `c` (`m x n`): `A · Bᵀ`, overwriting `c`. Single-threaded
/// (callers split the work across ferroquant's pool).
///
/// # Panics
/// If a slice is shorter than its shape says, a product of two dimensions
/// included (a caller bug, not bad input).
pub fn gemm_abt(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    // Checked products: a wrapped `m * k` would pass the check with short
    // slices, and the product below would then write outside them.
    let holds = |len: usize, rows: usize, cols: usize| {
        rows.checked_mul(cols).is_some_and(|need| len >= need)
    };
    assert!(
        holds(a.len(), m, k) && holds(b.len(), n, k) && holds(c.len(), m, n),
        "gemm_abt: slices shorter than {m} x {k}, {n} x {k} and {m} x {n}"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c[..m * n].fill(0.0);
        return;
    }
    let (k_, n_) = (k as isize, n as isize);
    // SAFETY: every index the product touches is inside the slices checked
    // above: a[i*k + p], b[j*k + p] (read as B's transpose: row stride 1,
    // column stride k) and c[i*n + j]; `c` is not read (read_dst = false)
    // and does not alias the inputs (it is a unique borrow).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n_,
            false,
            a.as_ptr(),
            1,
            k_,
            b.as_ptr(),
            k_,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
