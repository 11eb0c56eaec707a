/*
 * sampling.cu: greedy argmax over the logits on the device.
 *
 * argmax: x [n] -> out[0] = the index of the largest value (ties: lower index, NaN ignored),
 *   grid 1, block 1024: a strided scan per thread, then a shared-memory tree over the block.
 *
 * argmax_io (the device-resident greedy loop): the same argmax, then thread 0 feeds it back:
 *   io = [token, position, count] (the step's input slot, read by embed_row/attention): token <-
 *   argmax, position += 1, ring[count] = argmax, count += 1. A replayed step graph that ends with
 *   it runs the next token with no host involvement; the host reads the ring at the end.
 */
__device__ __forceinline__ int argmax_block(const float* x, int n) {
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float xv = x[i];
        if (xv > v || (xv == v && i < idx)) { v = xv; idx = i; }
    }
    bv[threadIdx.x] = v;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = bv[threadIdx.x + s];
            int oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    return bi[0] == 0x7fffffff ? 0 : bi[0];
}

extern "C" __global__ void argmax(const float* x, int n, int* out) {
    pdl_begin();
    int t = argmax_block(x, n);
    if (threadIdx.x == 0) out[0] = t;
}

extern "C" __global__ void argmax_io(const float* x, int n, int* io, int* ring) {
    pdl_begin();
    int t = argmax_block(x, n);
    if (threadIdx.x == 0) {
        io[0] = t;
        io[1] += 1;
        ring[io[2]] = t;
        io[2] += 1;
    }
}
