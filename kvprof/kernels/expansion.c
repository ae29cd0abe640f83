/* The low-rank view expansion, fused: out = base + RoPE(F·B) over rotary channels, base + F·B past them.
 *
 * Per head h and token j (the LR cache F shared by the heads; float32 throughout):
 *   e_c = sum_k F[j,k] B[h,k,c]                                   (c < d)
 *   out[h,j,c] = base[h,j,c] + e_c cos[j,c] + (sum_k F[j,k] S[h,k,c]) sin[j,c]   (c < rot, S given)
 *   out[h,j,c] = base[h,j,c] + e_c                                 (otherwise)
 * S is B with the rotary channels swapped as RoPE's sin term reads them (kvprof.model.rope.Rope.swap), so the sum is
 * RoPE of the rank-r term at token j's position. Tokens go four at a time with the heads inside, so B, S and the
 * cos/sin rows are read once per block of tokens; each output row is written once. d and rot: multiples of 16.
 * (The token loop's `if (t < count)` over a fixed 4 lets the compiler unroll it: a variable bound ran 1.7x slower.)
 * Strides in elements; the innermost (channel, rank) stride is 1. Built by kvprof.kernels.expansion.
 */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 load(const float *p) { return *(const v16 *)p; }
static inline void store(float *p, v16 v) { *(v16 *)p = v; }

static inline void expand_tokens(int count, int d, int r, int rot, const float *base, long base_ts,
                                 const float *f, long f_ts, const float *b, const float *s,
                                 const float *cos, const float *sin, long table_ts, float *out, long out_ts) {
    for (int c = 0; c < d; c += 16) {
        v16 acc[4] = {{0}, {0}, {0}, {0}};
        for (int k = 0; k < r; k++) {
            v16 row = load(b + (long)k * d + c);
            for (int t = 0; t < 4; t++) if (t < count) acc[t] += f[t * f_ts + k] * row;
        }
        if (s && c < rot) {
            v16 swapped[4] = {{0}, {0}, {0}, {0}};
            for (int k = 0; k < r; k++) {
                v16 row = load(s + (long)k * rot + c);
                for (int t = 0; t < 4; t++) if (t < count) swapped[t] += f[t * f_ts + k] * row;
            }
            for (int t = 0; t < 4; t++)
                if (t < count)
                    acc[t] = acc[t] * load(cos + t * table_ts + c) + swapped[t] * load(sin + t * table_ts + c);
        }
        for (int t = 0; t < 4; t++) if (t < count) store(out + t * out_ts + c, load(base + t * base_ts + c) + acc[t]);
    }
}

void kvprof_expand_f32(int heads, int n, int d, int r, int rot,
                       const float *base, long base_hs, long base_ts,
                       const float *f, long f_ts,
                       const float *b, const float *s,
                       const float *cos, const float *sin, long table_ts,
                       float *out, long out_hs, long out_ts) {
    for (int j = 0; j < n; j += 4) {
        int count = n - j < 4 ? n - j : 4;
        for (int h = 0; h < heads; h++) {
            expand_tokens(count, d, r, rot, base + h * base_hs + j * base_ts, base_ts, f + j * f_ts, f_ts,
                          b + (long)h * r * d, s ? s + (long)h * r * rot : 0, cos + j * table_ts,
                          sin + j * table_ts, table_ts, out + h * out_hs + j * out_ts, out_ts);
        }
    }
}
