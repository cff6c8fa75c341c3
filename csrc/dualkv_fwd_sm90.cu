// Native Hopper (sm_90a) forward of DualKV attention for head dims 128, 256 and 512, on wgmma
// instructions fed by TMA.
//
// One CTA per (query tile inside one segment, query head): the tables of the Triton forward
// (megatron_dualkv/ops/dualkv_attn.py, query_tiles with Tiles<D>::BLOCK_M-row tiles). Warpgroup 0
// is the producer: one warp streams blocks of BLOCK_N keys (128 at D = 128, 64 at D = 256, 32 at
// D = 512) into 2-stage K and V rings, first the tile's ancestor keys (every key visible), then the
// tile's own segment up to the tile's end (causal). The ancestors are one range, the group's
// prompt, in depth-1 tiles (5 ints); in a prefix tree (DFS order) they are a few *pieces*
// (multi-piece tiles, 6 ints, the PIECES instantiations: a piece table of (start, length,
// position) rows, the tile's from piece_lo to piece_hi). Each ancestor range is read in blocks
// aligned to its own start, its last block cut at its end; positions count on along the path, so
// a window skips a piece's blocks wholly below the tile's first row's reach. The producer walks
// the pieces and leaves each block's place in its piece in a ring of records for the consumers'
// masks; depth-1 kernels compute it from the block index, as before.
// Warpgroups 1 and 2 own 64 query rows each (at D = 512: the same 64 rows, half the columns each;
// see Tiles and the end of this comment) and keep flash-attention 2's online softmax in registers
// (log2 units, scale_log2 = softmax scale * log2 e):
//     S = Q_w K^T (64 x BLOCK_N, wgmma from shared memory)
//     m' = max(m, rowmax S * scale_log2),  P = 2^(S * scale_log2 - m')
//     l = l 2^(m - m') + rowsum P,  O = O 2^(m - m') + P V   (P V: P stays in registers as the
//                                                              A operand; 128 columns per wgmma)
//     at the end O /= l and lse = m + log2 l, as the Triton forward stores it.
// m need not be the running max, only within RESCALE_LOG2 below it, so that P <= 2^8 cannot
// overflow: a warp keeps its rows' m until one of them would grow by more than that, and most
// blocks skip the rescale of O (O / l and lse are the same).
// The consumer warpgroups take turns issuing their matmuls (ping-pong, see the main loop), so that
// one's softmax overlaps the other's matmuls on the tensor cores. O takes 128 registers per thread
// at D = 256 and 512, hence the smaller key blocks there.
//
// At D = 512 the two warpgroups share the rows, so each computes S over its half of the head dim
// only (Q_w K_w^T, 256 columns) and they add their partial S through shared memory (xs): the same
// S in both (a + b == b + a in fp32), and no S matmul done twice. That holds them in lockstep, so
// instead of ping-pong each warpgroup overlaps its own work: S of block b+1 runs during the
// softmax of block b, and the exchange of that S during P V of block b.
#include "dualkv_sm90.h"
#include "sm90_ptx.cuh"

namespace dualkv_sm90 {
namespace {

constexpr int STAGES = 2;  // per ring; K of block b is released after S_b, V after P_b V_b
constexpr float RESCALE_LOG2 = 8.f;  // how far a row's max may run ahead of its m (log2 units)
constexpr int THREADS = 384;

// The tiles of head dim D. How the two consumer warpgroups share a CTA's query tile: up to D = 256
// each owns 64 rows and all columns (O: D / 2 registers per thread). At D = 512 that would be 256
// registers, so each owns half the columns of the same 64 rows instead, and both need the same S
// (each computes its half of the head dim's sum; see the top). Key blocks shrink as O grows (128
// keys at D = 128, 64 at 256, 32 at 512), so that S and P fit beside O and a 2-stage K and V ring
// fits in shared memory.
template <int D>
struct Tiles {
  static constexpr bool SPLIT_COLUMNS = D > 256;
  static constexpr int BLOCK_M = SPLIT_COLUMNS ? 64 : 128;  // query rows per CTA
  static constexpr int BLOCK_N = 128 * 128 / D;             // keys per block
  static constexpr int O_COLS = SPLIT_COLUMNS ? D / 2 : D;  // output columns per warpgroup
  static constexpr int PANELS = D / 64;
};

constexpr int RECORDS = 4;  // multi-piece tiles: the producer's ring of block records (see the producer)

template <int D, bool PIECES>
struct alignas(1024) SharedStorage {
  static constexpr int PANELS = Tiles<D>::PANELS, BLOCK_N = Tiles<D>::BLOCK_N;
  uint8_t q[PANELS][Tiles<D>::BLOCK_M * ROW_BYTES];
  uint8_t k[STAGES][PANELS][BLOCK_N * ROW_BYTES];
  uint8_t v[STAGES][PANELS][BLOCK_N * ROW_BYTES];
  uint64_t q_full;
  uint64_t k_full[STAGES], k_empty[STAGES];
  uint64_t v_full[STAGES], v_empty[STAGES];
  // at D = 512, each warpgroup's partial S of a block (by block parity): float4 j of consumer
  // thread t at j * 128 + t, so that a warp's accesses hit consecutive banks
  float4 xs[Tiles<D>::SPLIT_COLUMNS ? 2 : 1][2][Tiles<D>::SPLIT_COLUMNS ? BLOCK_N / 8 * 128 : 1];
  // multi-piece tiles: per ancestor block b, at b % RECORDS, (index of its first key in its piece,
  // the piece's length, the first key's position); one slot unused in depth-1 kernels (the end
  // padding of the 1024-byte alignment holds it: the same size and layout as without it)
  int4 records[PIECES ? RECORDS : 1];
};

// With a window, the lowest position that a tile's first row sees: that row is row i0 of its
// segment, which starts at position seg_pos
__device__ __forceinline__ int window_start(int seg_pos, int i0, int window) { return seg_pos + i0 - window + 1; }

// The key blocks of an ancestor range of `length` keys at positions from `position` on that a
// tile reads: (first, count), counted from the range's start. With a window only the keys from
// position first_pos on (its first row's position - window + 1) can be visible.
template <int BLOCK_N, bool WINDOW>
__device__ __forceinline__ int2 visible_blocks(int length, int position, int first_pos) {
  const int all = (length + BLOCK_N - 1) / BLOCK_N;
  int first = 0;
  if constexpr (WINDOW) first = first_pos - position >= length ? all : max(first_pos - position, 0) / BLOCK_N;
  return make_int2(first, all - first);
}

// Add the other consumer warpgroup's partial S of a block (its half of the head dim) to acc, through
// xs (the buffers of the block's parity). (A function, not a lambda: called twice, a lambda is not
// always inlined, and an array passed to one can go to local memory.)
template <int N>
__device__ __forceinline__ void add_partner_s(float (&acc)[N], float4 (*xs)[N / 4 * 128], int wg) {
  const int t = threadIdx.x % 128;
#pragma unroll
  for (int j = 0; j < N / 4; ++j)
    xs[wg][j * 128 + t] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  consumers_sync();
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const float4 r = xs[wg ^ 1][j * 128 + t];
    acc[4 * j] += r.x, acc[4 * j + 1] += r.y, acc[4 * j + 2] += r.z, acc[4 * j + 3] += r.w;
  }
}

struct KernelParams {
  const int32_t* tiles;
  void* out;
  int64_t out_stride_t, out_stride_h;
  float* lse;
  int T, num_heads, group;
  float scale_log2;
  int window;
  const int32_t* pieces;  // multi-piece tiles' (n_pieces, 3) table; last, so that the others keep their offsets
};

// Accumulator element e (0..3) of 8-column group i held by a thread: row 16 * warp + lane / 4
// (+ 8 for e >= 2), column 8 i + 2 (lane % 4) (+ 1 for odd e).
template <typename T, int D, bool WINDOW, bool PIECES>
__global__ void __launch_bounds__(THREADS, 1)
    fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
               const __grid_constant__ CUtensorMap tm_v, const KernelParams p) {
  using Tile = Tiles<D>;
  constexpr int PANELS = Tile::PANELS, BLOCK_M = Tile::BLOCK_M, BLOCK_N = Tile::BLOCK_N, O_COLS = Tile::O_COLS;
  constexpr bool SPLIT_COLUMNS = Tile::SPLIT_COLUMNS;
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<D, PIECES>& s = aligned_shared<SharedStorage<D, PIECES>>(smem_raw);

  // heads vary slowest, so that the CTAs running at once stream the same keys and values (from L2);
  // inside a head the heaviest tiles (tables are sorted heaviest first) start first
  const int n_tiles = gridDim.x / p.num_heads;
  const int h = blockIdx.x / n_tiles;
  // a depth-1 tile: (q_start, q_end, seg_start, prefix_start, prefix_len), the prompt's keys
  // [prefix_start, + prefix_len); a multi-piece tile holds (seg_pos, piece_lo) in place of the
  // prompt, then piece_hi: its pieces are p.pieces rows piece_lo .. piece_hi - 1
  const int32_t* tile = p.tiles + (blockIdx.x % n_tiles) * (PIECES ? 6 : 5);
  const int q_start = tile[0], q_end = tile[1], seg_start = tile[2], prefix_start = tile[3], prefix_len = tile[4];
  // Positions: the ancestors' keys sit at 0 .. seg_pos - 1 (the prompt's at 0 .. prefix_len - 1),
  // the segment's rows and keys run on from seg_pos (a root is its own segment, seg_pos 0). A
  // window leaves visible only the keys from the tile's first row's position - window + 1 on
  // (first_pos): the first visible prompt (per piece: visible_blocks) and segment blocks are
  // prefix_first and seg_first. Block b counts from them: ancestor_blocks blocks of the prompt or
  // the pieces, then the segment's.
  const int seg_pos = PIECES ? prefix_start : prefix_len;
  int prefix_first = 0, seg_first = 0, ancestor_blocks = 0;
  if constexpr (PIECES) {
    const int first_pos = window_start(seg_pos, q_start - seg_start, p.window);
    for (int i = prefix_len; i < tile[5]; ++i)
      ancestor_blocks += visible_blocks<BLOCK_N, WINDOW>(p.pieces[3 * i + 1], p.pieces[3 * i + 2], first_pos).y;
    if constexpr (WINDOW) seg_first = max(first_pos - seg_pos, 0) / BLOCK_N;
  } else {  // visible_blocks of the prompt, written out: through it ptxas schedules the depth-1 kernels otherwise
    const int prefix_all = (prefix_len + BLOCK_N - 1) / BLOCK_N;
    if constexpr (WINDOW) {
      const int first_pos = prefix_len + (q_start - seg_start) - p.window + 1;
      prefix_first = first_pos >= prefix_len ? prefix_all : max(first_pos, 0) / BLOCK_N;
      seg_first = max(first_pos - prefix_len, 0) / BLOCK_N;
    }
    ancestor_blocks = prefix_all - prefix_first;
  }
  const int blocks = ancestor_blocks + (q_end - seg_start + BLOCK_N - 1) / BLOCK_N - seg_first;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbar_init(&s.q_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.k_full[i], 1);
      mbar_init(&s.v_full[i], 1);
      mbar_init(&s.k_empty[i], 8);  // one lane per consumer warp
      mbar_init(&s.v_empty[i], 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {  // ---------------------------------------------------------------- producer
    setmaxnreg_dec<24>();
    if (threadIdx.x != 0) return;
    const int hk = h / p.group;
    mbar_arrive_expect_tx(&s.q_full, BLOCK_M * D * sizeof(T));
    for (int pnl = 0; pnl < PANELS; ++pnl) tma_load(s.q[pnl], &tm_q, &s.q_full, 64 * pnl, h, q_start);
    // K and V of block b, whose first key is packed row key0
    const auto stream = [&](int b, int key0) {
      const int st = b % STAGES, phase = ((b / STAGES) & 1) ^ 1;
      mbar_wait(&s.k_empty[st], phase);
      mbar_arrive_expect_tx(&s.k_full[st], BLOCK_N * D * sizeof(T));
      for (int pnl = 0; pnl < PANELS; ++pnl) tma_load(s.k[st][pnl], &tm_k, &s.k_full[st], 64 * pnl, hk, key0);
      mbar_wait(&s.v_empty[st], phase);
      mbar_arrive_expect_tx(&s.v_full[st], BLOCK_N * D * sizeof(T));
      for (int pnl = 0; pnl < PANELS; ++pnl) tma_load(s.v[st][pnl], &tm_v, &s.v_full[st], 64 * pnl, hk, key0);
    };
    if constexpr (PIECES) {
      // The record of block b goes to slot b % RECORDS before its K is announced (k_full). That
      // slot's last block, b - 4, has been through its softmax: the consumers did that before
      // releasing K of block b - 3, which the producer waited for to stream block b - 1.
      const int first_pos = window_start(seg_pos, q_start - seg_start, p.window);
      int b = 0;
      for (int i = prefix_len; i < tile[5]; ++i) {
        const int start = p.pieces[3 * i], length = p.pieces[3 * i + 1], position = p.pieces[3 * i + 2];
        const int2 visible = visible_blocks<BLOCK_N, WINDOW>(length, position, first_pos);
        for (int j = visible.x; j < visible.x + visible.y; ++j, ++b) {
          s.records[b % RECORDS] = make_int4(j * BLOCK_N, length, position + j * BLOCK_N, 0);
          stream(b, start + j * BLOCK_N);
        }
      }
      for (int j = seg_first; b < blocks; ++j, ++b) stream(b, seg_start + j * BLOCK_N);
    } else {
      for (int b = 0; b < blocks; ++b)
        stream(b, b < ancestor_blocks ? prefix_start + (prefix_first + b) * BLOCK_N
                                      : seg_start + (seg_first + b - ancestor_blocks) * BLOCK_N);
    }
    return;
  }

  // -------------------------------------------------------------------------------- consumers
  setmaxnreg_inc<240>();
  const int wg = consumer_warpgroup();  // rows [64 wg, 64 wg + 64) of the tile, or columns [O_COLS wg, + O_COLS)
  const int wq = warp % 4;
  const int g = lane / 4, c = lane % 4;
  const int row0 = SPLIT_COLUMNS ? 0 : 64 * wg;        // the warpgroup's first row in the tile
  const int col0 = SPLIT_COLUMNS ? O_COLS * wg : 0;    // and its first output column
  const int wg_first = q_start + row0 - seg_start;     // the warpgroup's first row, as a segment index
  const int row_index = wg_first + 16 * wq + g;        // this thread's first row (second: + 8)

  float o[O_COLS / 2];
#pragma unroll
  for (int i = 0; i < O_COLS / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float sc[BLOCK_N / 2];
  uint32_t pa[BLOCK_N / 4];  // P of the last block, bf16/fp16, the A operand of its P V

  // Online softmax of block b on S in sc, in three parts: P in sc (unpacked), l and m updated, and
  // alpha, the factor of O (1 unless rescale); O rescaled; P packed into pa
  float alpha[2];
  bool rescale = true;
  const auto softmax_p = [&](int b) {
    // an ancestor range: keys past its end are invisible; the segment: keys after the query are;
    // with a window, keys whose position is window or more below the query's. The block's first
    // key: its index in its range, and its position (window only); the range's length.
    const bool in_prefix = b < ancestor_blocks;
    int key_index0, key_pos0, range_len = seg_pos;  // depth 1: the prompt, seg_pos keys long
    if constexpr (PIECES) {
      if (in_prefix) {
        const int4 record = s.records[b % RECORDS];
        key_index0 = record.x, range_len = record.y, key_pos0 = record.z;
      } else {
        key_index0 = (seg_first + b - ancestor_blocks) * BLOCK_N;
        key_pos0 = seg_pos + key_index0;
      }
    } else {
      key_index0 = (in_prefix ? prefix_first + b : seg_first + b - ancestor_blocks) * BLOCK_N;
      key_pos0 = in_prefix ? key_index0 : seg_pos + key_index0;
    }
    if ((in_prefix ? key_index0 + BLOCK_N > range_len : key_index0 + BLOCK_N - 1 > wg_first) ||
        (WINDOW && seg_pos + wg_first + 63 - key_pos0 >= p.window)) {
#pragma unroll
      for (int i = 0; i < BLOCK_N / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_index0 + 8 * i + 2 * c + (e & 1), row = row_index + 8 * (e >> 1);
          const bool beyond = WINDOW && seg_pos + row - (key_pos0 + 8 * i + 2 * c + (e & 1)) >= p.window;
          if ((in_prefix ? key >= range_len : key > row) || beyond) sc[4 * i + e] = -INFINITY;
        }
      }
    }
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < BLOCK_N / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) row_max[e >> 1] = fmaxf(row_max[e >> 1], sc[4 * i + e]);
    }
    float m_sub[2], m_new[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffff, row_max[r], 1));
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffff, row_max[r], 2));
      m_new[r] = fmaxf(m[r], row_max[r] * p.scale_log2);
    }
    // the warp's rows keep their m unless one of them would grow past it by more than
    // RESCALE_LOG2 (or has none yet): then all take the new max, and O is rescaled
    rescale = __any_sync(0xffffffff, m_new[0] - m[0] > RESCALE_LOG2 || m_new[1] - m[1] > RESCALE_LOG2 ||
                                         m[0] == -INFINITY || m[1] == -INFINITY);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_use = rescale ? m_new[r] : m[r];
      // a row that has seen no visible key keeps m = -inf: subtract 0 so that P = 0, not NaN
      m_sub[r] = m_use == -INFINITY ? 0.f : m_use;
      alpha[r] = exp2_approx(m[r] - m_sub[r]);
      m[r] = m_use;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < BLOCK_N / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = exp2_approx(sc[4 * i + e] * p.scale_log2 - m_sub[e >> 1]);
        sc[4 * i + e] = x;
        l[e >> 1] += x;
      }
    }
  };
  const auto rescale_o = [&] {
#pragma unroll
    for (int i = 0; i < O_COLS / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[4 * i + e] *= alpha[e >> 1];
    }
  };
  const auto softmax = [&](int b) {
    softmax_p(b);
    if (rescale) rescale_o();
    pack_fragments<T>(sc, pa);
  };
  // S = Q_w K^T of block b
  const auto issue_s = [&](int b) {
    mma_ss_head_dim<T, D>(sc, s.q[0] + row0 * ROW_BYTES, sizeof(s.q[0]), s.k[b % STAGES][0], sizeof(s.k[0][0]));
  };
  // O += P V of block b in 128-column chunks: B = V read N-major (head dim contiguous), k-steps of 16 keys
  const auto issue_pv = [&](int b) {
#pragma unroll
    for (int chunk = 0; chunk < O_COLS / 128; ++chunk)
      mma_rs<T, BLOCK_N / 16>(*reinterpret_cast<float(*)[64]>(o + 64 * chunk), pa,
                              s.v[b % STAGES][col0 / 64 + 2 * chunk], BLOCK_N * ROW_BYTES);
  };
  const auto wait_all = [&] {
    wgmma_wait<0>();
    fence_regs(sc);
    fence_regs(o);
    fence_regs(pa);
  };
  const auto release = [&](uint64_t* empty) {  // this warp is done with a K or V block
    __syncwarp();
    if (lane == 0) mbar_arrive(empty);
  };

  if constexpr (SPLIT_COLUMNS) {
    // S_w = Q_w K_w^T of block b over the warpgroup's half of the head dim
    const auto issue_s_half = [&](float (&acc)[BLOCK_N / 2], int b) {
      mma_ss_head_dim<T, D / 2>(acc, s.q[PANELS / 2 * wg], sizeof(s.q[0]), s.k[b % STAGES][PANELS / 2 * wg],
                                sizeof(s.k[0][0]));
    };
    float sn[BLOCK_N / 2];  // S of the next block
    mbar_wait(&s.q_full, 0);
    mbar_wait(&s.k_full[0], 0);
    wgmma_fence();
    issue_s_half(sc, 0);
    wgmma_wait<0>();
    fence_regs(sc);
    release(&s.k_empty[0]);
    add_partner_s(sc, s.xs[0], wg);
    // O is rescaled only while no matmul runs: ptxas serializes every wgmma of a pipeline stage
    // in which other instructions touch an accumulator of one (its warning C7514). The last block
    // is peeled off the loop: with the next block's S issued under a condition, ptxas did that.
    const auto finish_block = [&](int b) {  // P V of block b, once S of block b + 1 (if any) is done
      if (rescale) rescale_o();
      mbar_wait(&s.v_full[b % STAGES], (b / STAGES) & 1);
      issue_pv(b);
    };
    for (int b = 0; b + 1 < blocks; ++b) {
      mbar_wait(&s.k_full[(b + 1) % STAGES], ((b + 1) / STAGES) & 1);
      wgmma_fence();
      issue_s_half(sn, b + 1);
      softmax_p(b);               // while S of block b + 1 runs
      pack_fragments<T>(sc, pa);  // P V of block b - 1, the last reader of pa, has completed
      wgmma_wait<0>();
      fence_regs(sn);
      release(&s.k_empty[(b + 1) % STAGES]);
      finish_block(b);
      add_partner_s(sn, s.xs[(b + 1) % 2], wg);  // while P V of block b runs
      wait_all();
      release(&s.v_empty[b % STAGES]);
#pragma unroll
      for (int i = 0; i < BLOCK_N / 2; ++i) sc[i] = sn[i];
    }
    softmax_p(blocks - 1);
    pack_fragments<T>(sc, pa);
    finish_block(blocks - 1);
    wait_all();
  } else {
    // Ping-pong: a warpgroup issues P V of block b-1 and S of block b back to back in its turn,
    // then passes the turn and runs the softmax of block b while the other warpgroup's matmuls
    // keep the tensor cores busy. No matmul is in flight during a softmax, so ptxas has no reason
    // to insert waits there (PERF_NOTES.md, session 4). Warpgroup 0 takes the first turn.
    if (wg == 1) turn_pass(wg);
    mbar_wait(&s.q_full, 0);
    mbar_wait(&s.k_full[0], 0);
    turn_wait(wg);
    wgmma_fence();
    issue_s(0);
    turn_pass(wg);
    wait_all();
    release(&s.k_empty[0]);
    softmax(0);
    for (int b = 1; b < blocks; ++b) {
      mbar_wait(&s.k_full[b % STAGES], (b / STAGES) & 1);
      mbar_wait(&s.v_full[(b - 1) % STAGES], ((b - 1) / STAGES) & 1);
      turn_wait(wg);
      wgmma_fence();
      issue_pv(b - 1);
      issue_s(b);
      turn_pass(wg);
      wait_all();
      release(&s.k_empty[b % STAGES]);
      release(&s.v_empty[(b - 1) % STAGES]);
      softmax(b);
    }
    mbar_wait(&s.v_full[(blocks - 1) % STAGES], ((blocks - 1) / STAGES) & 1);
    turn_wait(wg);
    wgmma_fence();
    issue_pv(blocks - 1);
    turn_pass(wg);
    wait_all();
    if (wg == 0) turn_wait(wg);  // the pass warpgroup 1 made last
  }

  // O / l and lse; rows past the tile (a partial last tile) are not stored
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
    const int64_t row = seg_start + row_index + 8 * r;
    if (row >= q_end) continue;
    const float inv = 1.f / l[r];  // every row sees at least its own key
    T* out = static_cast<T*>(p.out) + row * p.out_stride_t + h * p.out_stride_h + col0 + 2 * c;
#pragma unroll
    for (int i = 0; i < O_COLS / 8; ++i)
      *reinterpret_cast<uint32_t*>(out + 8 * i) = pack2<T>(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    if (c == 0 && col0 == 0) p.lse[int64_t(h) * p.T + row] = m[r] + __log2f(l[r]);
  }
}

template <typename T, int D, bool WINDOW, bool PIECES>
void launch(const FwdArgs& a, cudaStream_t stream) {
  using Tile = Tiles<D>;
  static_assert(!WINDOW || !Tile::SPLIT_COLUMNS, "windows: head dims 128 and 256");
  const auto kernel = fwd_kernel<T, D, WINDOW, PIECES>;
  constexpr int SMEM_BYTES = shared_bytes<SharedStorage<D, PIECES>>();
  static_assert(SMEM_BYTES <= 227 * 1024, "over the shared memory of an sm_90 CTA");
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  const auto dtype = a.fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUtensorMap tm_q =
      head_tile_map(a.qkv.q, dtype, 2, a.T, a.num_heads, D, a.qkv.q_stride_t, a.qkv.q_stride_h, Tile::BLOCK_M);
  const CUtensorMap tm_k = head_tile_map(a.qkv.k, dtype, 2, a.T, a.num_kv_heads, D, a.qkv.k_stride_t, a.qkv.k_stride_h, Tile::BLOCK_N);
  const CUtensorMap tm_v = head_tile_map(a.qkv.v, dtype, 2, a.T, a.num_kv_heads, D, a.qkv.v_stride_t, a.qkv.v_stride_h, Tile::BLOCK_N);
  const KernelParams p{a.tiles, a.out, a.out_stride_t, a.out_stride_h, a.lse, a.T, a.num_heads,
                       a.num_heads / a.num_kv_heads, float(a.sm_scale * LOG2E), a.window, a.pieces};
  kernel<<<a.n_tiles * a.num_heads, THREADS, SMEM_BYTES, stream>>>(tm_q, tm_k, tm_v, p);
}

template <typename T, bool PIECES>
void launch_for_head_dim(const FwdArgs& a, cudaStream_t s) {
  const bool window = a.window > 0;
  if (a.head_dim == 128)
    window ? launch<T, 128, true, PIECES>(a, s) : launch<T, 128, false, PIECES>(a, s);
  else if (a.head_dim == 256)
    window ? launch<T, 256, true, PIECES>(a, s) : launch<T, 256, false, PIECES>(a, s);
  else
    launch<T, 512, false, PIECES>(a, s);
}

}  // namespace

void fwd(const FwdArgs& args, void* stream) {
  if (args.n_tiles == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  launch_for_dtype(args.fp16, [&](auto t) {
    using T = decltype(t);
    args.pieces ? launch_for_head_dim<T, true>(args, s) : launch_for_head_dim<T, false>(args, s);
  });
}

}  // namespace dualkv_sm90
