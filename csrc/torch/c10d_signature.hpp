/* The C++ "mpidp" backend's call signatures (csrc/py/c10d_api.h's layout),
 * which the ranks' check compares, and the message that names what each
 * group of ranks passed when they differ. */
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "../py/c10d_api.h"
#include "c10d_tensors.hpp"

namespace mpidp_c10d {

/* FNV-1a, for the signature's names and shapes (the same on every rank). */
inline int64_t fnv(const void *data, size_t n, uint64_t h = 1469598103934665603ull)
{
    const unsigned char *p = static_cast<const unsigned char *>(data);
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<int64_t>(h >> 2);     /* within (-2^63, 2^63): every negation exists */
}

using Signature = std::array<int64_t, MPIDP_C10D_SIG_FIELDS>;

/* The calls the backend hands to its Python group, numbered for their
 * signatures (MPIDP_C10D_CALL_OTHER + the index); torch's names where they
 * differ from the method's. Point-to-point calls are not checked. */
inline const std::vector<std::pair<const char *, const char *>> &python_calls()
{
    static const std::vector<std::pair<const char *, const char *>> calls = {
        {"allreduce", "all_reduce"},
        {"broadcast", "broadcast"},
        {"_allgather_base", "all_gather_into_tensor"},
        {"_reduce_scatter_base", "reduce_scatter_tensor"},
        {"allreduce_coalesced", "all_reduce_coalesced"},
        {"reduce", "reduce"},
        {"allgather", "all_gather"},
        {"allgather_coalesced", "all_gather_coalesced"},
        {"all_gather_single_coalesced", "all_gather_into_tensor_coalesced"},
        {"gather", "gather"},
        {"scatter", "scatter"},
        {"reduce_scatter", "reduce_scatter"},
        {"reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced"},
        {"all_to_all_single", "all_to_all_single"},
        {"alltoall", "all_to_all"},
    };
    return calls;
}

/* The index of a Python group's method in python_calls(), -1 for none (a
 * point-to-point call). */
inline int python_call_index(const char *method)
{
    const auto &calls = python_calls();
    for (size_t i = 0; i < calls.size(); i++)
        if (std::strcmp(calls[i].first, method) == 0) return static_cast<int>(i);
    return -1;
}

/* A fast call's signature: its code, the tensor's dtype, shape and place,
 * the op and the root (-1: none). `t` may be null (a barrier). */
inline Signature signature(int call, const at::Tensor *t, int op, int root)
{
    Signature s{};
    s[MPIDP_C10D_SIG_CALL] = call;
    s[MPIDP_C10D_SIG_OP] = op;
    s[MPIDP_C10D_SIG_ROOT] = root;
    s[MPIDP_C10D_SIG_DTYPE] = -1;
    if (t == nullptr) return s;
    s[MPIDP_C10D_SIG_DTYPE] = core_dtype(t->scalar_type());
    s[MPIDP_C10D_SIG_TORCH_DTYPE] = static_cast<int64_t>(t->scalar_type());
    s[MPIDP_C10D_SIG_NDIM] = t->dim();
    for (int64_t d = 0; d < MPIDP_C10D_SIG_NDIMS; d++)
        s[MPIDP_C10D_SIG_DIMS + d] = d < t->dim() ? t->size(d) : -2;
    auto sizes = t->sizes();
    s[MPIDP_C10D_SIG_SHAPE] = fnv(sizes.data(), sizes.size() * sizeof(int64_t));
    s[MPIDP_C10D_SIG_NUMEL] = t->numel();
    s[MPIDP_C10D_SIG_PLACE] = static_cast<int64_t>(t->device().type()) * 16 +
                              static_cast<int64_t>(t->layout());
    return s;
}

/* The signature of a call the Python group makes (it checks the tensors). */
inline Signature python_signature(int index)
{
    return signature(MPIDP_C10D_CALL_OTHER + index, nullptr, -1, -1);
}

inline std::string call_name(int64_t call)
{
    switch (call) {
    case MPIDP_C10D_CALL_ALLREDUCE: return "all_reduce";
    case MPIDP_C10D_CALL_BCAST: return "broadcast";
    case MPIDP_C10D_CALL_ALLGATHER: return "all_gather_into_tensor";
    case MPIDP_C10D_CALL_REDUCE_SCATTER: return "reduce_scatter_tensor";
    case MPIDP_C10D_CALL_BARRIER: return "barrier";
    }
    size_t i = static_cast<size_t>(call - MPIDP_C10D_CALL_OTHER);
    if (call >= MPIDP_C10D_CALL_OTHER && i < python_calls().size())
        return std::string(python_calls()[i].second) +
               " (with tensors or settings the backend hands to its Python group)";
    return "call #" + std::to_string(call);
}

/* torch's Python name of a dtype ("float32"), as users write it. */
inline std::string dtype_name(int64_t scalar_type)
{
    switch (static_cast<at::ScalarType>(scalar_type)) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return c10::toString(static_cast<at::ScalarType>(scalar_type));
    }
}

/* One rank's call, as the message names it. */
inline std::string describe(const int64_t *sig, int op_sum, int op_avg, int op_min, int op_max,
                            int op_prod)
{
    std::string s = call_name(sig[MPIDP_C10D_SIG_CALL]);
    if (sig[MPIDP_C10D_SIG_CALL] >= MPIDP_C10D_CALL_OTHER ||
        sig[MPIDP_C10D_SIG_CALL] == MPIDP_C10D_CALL_BARRIER)
        return s;
    s += " of ";
    s += dtype_name(sig[MPIDP_C10D_SIG_TORCH_DTYPE]);
    s += " [";
    int64_t ndim = sig[MPIDP_C10D_SIG_NDIM];
    for (int64_t d = 0; d < ndim && d < MPIDP_C10D_SIG_NDIMS; d++)
        s += (d ? ", " : "") + std::to_string(sig[MPIDP_C10D_SIG_DIMS + d]);
    if (ndim > MPIDP_C10D_SIG_NDIMS) s += ", ...";
    s += "] on ";
    s += c10::DeviceTypeName(static_cast<c10::DeviceType>(sig[MPIDP_C10D_SIG_PLACE] / 16), true);
    int64_t op = sig[MPIDP_C10D_SIG_OP];
    if (op >= 0) {
        const std::map<int64_t, const char *> names = {
            {op_sum, "sum"}, {op_avg, "avg"}, {op_min, "min"}, {op_max, "max"},
            {op_prod, "product"}};
        auto it = names.find(op);
        s += std::string(", op ") + (it != names.end() ? it->second : "?");
    }
    if (sig[MPIDP_C10D_SIG_ROOT] >= 0) s += ", root " + std::to_string(sig[MPIDP_C10D_SIG_ROOT]);
    return s;
}

/* Ranks of a group as a message names them: "rank(s) [0, 2]" on the
 * default group, "global rank(s) [3, 5] (group rank(s) [0, 2])" on another
 * (`global`: the group's ranks in the default group, empty for it). */
inline std::string name_ranks(const std::vector<int> &ranks, const std::vector<int> &global)
{
    auto list = [](const std::vector<int> &rs, auto &&name) {
        std::string text = "[";
        for (size_t i = 0; i < rs.size(); i++) text += (i ? ", " : "") + std::to_string(name(rs[i]));
        return text + "]";
    };
    std::string group = list(ranks, [](int r) { return r; });
    if (global.empty()) return "rank(s) " + group;
    return "global rank(s) " +
           list(ranks, [&](int r) { return r < static_cast<int>(global.size()) ? global[r] : -1; }) +
           " (group rank(s) " + group + ")";
}

/* Every group of ranks that passed the same, and what it passed:
 * "rank(s) [0, 2]: all_reduce of float32 [4, 8] on cpu, op sum; rank(s) [1]: ...". */
template <typename Describe>
std::string describe_ranks(const int64_t *rows, int size, const std::vector<int> &global,
                           Describe &&describe_one)
{
    std::vector<std::pair<const int64_t *, std::vector<int>>> groups;
    for (int r = 0; r < size; r++) {
        const int64_t *row = rows + static_cast<size_t>(r) * MPIDP_C10D_ROW;
        bool found = false;
        for (auto &g : groups)
            if (std::memcmp(g.first, row, sizeof(int64_t) * MPIDP_C10D_SIG_FIELDS) == 0) {
                g.second.push_back(r);
                found = true;
                break;
            }
        if (!found) groups.push_back({row, {r}});
    }
    std::string text;
    for (const auto &g : groups)
        text += (text.empty() ? "" : "; ") + name_ranks(g.second, global) + ": " +
                describe_one(g.first);
    return text;
}

}  // namespace mpidp_c10d
