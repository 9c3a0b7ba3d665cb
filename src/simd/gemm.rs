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
    gemm_abt_strided(m, n, k, (a, k), (b, k), c, false)
}

/// [`gemm_abt`] over rows `lda` and `ldb` floats apart (`a` row `i` at
/// `a[i·lda..]`, `b` row `j` at `b[j·ldb..]`, each `k` long); with
/// `accumulate`, `c += A · Bᵀ` instead of `c = A · Bᵀ`.
///
/// # Panics
/// If a slice is shorter than its shape and stride say, or a stride is
/// shorter than `k` (a caller bug, not bad input).
pub fn gemm_abt_strided(
    m: usize,
    n: usize,
    k: usize,
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    c: &mut [f32],
    accumulate: bool,
) {
    // Checked arithmetic: a wrapped product would pass the check with short
    // slices, and the product below would then write outside them.
    let holds = |len: usize, rows: usize, stride: usize| {
        rows == 0
            || (rows - 1)
                .checked_mul(stride)
                .and_then(|s| s.checked_add(k))
                .is_some_and(|need| len >= need)
    };
    assert!(
        lda >= k
            && ldb >= k
            && holds(a.len(), m, lda)
            && holds(b.len(), n, ldb)
            && m.checked_mul(n).is_some_and(|mn| c.len() >= mn),
        "gemm_abt: slices shorter than {m} x {k}, {n} x {k} and {m} x {n}"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    let (lda, ldb, n_) = (lda as isize, ldb as isize, n as isize);
    // SAFETY: every index the product touches is inside the slices checked
    // above: a[i*lda + p], b[j*ldb + p] (read as B's transpose: row stride
    // 1, column stride ldb) and c[i*n + j] for i < m, j < n, p < k; `c` is
    // read only with `accumulate` and does not alias the inputs (it is a
    // unique borrow).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n_,
            accumulate,
            a.as_ptr(),
            1,
            lda,
            b.as_ptr(),
            ldb,
            1,
            if accumulate { 1.0f32 } else { 0.0f32 },
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
