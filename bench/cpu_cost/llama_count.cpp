// llama_count: llama.cpp's side of `simmer bench cpu-cost`, the guest program whose instructions are counted.
//
//   llama_count MODEL.gguf N_DECODE ID,ID,...
//
// One thread; the prompt's token ids in one llama_decode (prefill), then N_DECODE greedy steps of one token
// each (argmax of the logits, as simmer's guest does). Before the prefill, after it and after every decode
// step it makes a marker, close(MARK_FD), which insn_count.c records; the generated ids go to stdout so the
// two engines' tokens can be compared. Built against vendor/llama.cpp's static libraries (build.sh).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static const int MARK_FD = 0x51ee7;  // insn_count.c's

// steady-clock ns at each marker, printed to stderr at the end: natively the time is what is measured
static std::vector<long long> times;

static void mark() {
    times.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
    close(MARK_FD);
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N_DECODE ID,ID,...\n", argv[0]);
        return 2;
    }
    const int n_decode = atoi(argv[2]);
    std::vector<llama_token> ids;
    std::stringstream ss(argv[3]);
    for (std::string item; std::getline(ss, item, ',');) {
        ids.push_back(static_cast<llama_token>(atoi(item.c_str())));
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    // read the weights at load, not page by page at their first use: the prefill's time is the prefill's
    mp.load_mode = LLAMA_LOAD_MODE_NONE;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    mark();
    if (llama_decode(ctx, llama_batch_get_one(ids.data(), static_cast<int32_t>(ids.size())))) {
        fprintf(stderr, "prefill failed\n");
        return 1;
    }
    for (int step = 0; step <= n_decode; step++) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        llama_token best = 0;
        for (int v = 1; v < n_vocab; v++) {
            if (logits[v] > logits[best]) {
                best = v;
            }
        }
        mark();  // step 0: the prefill's end; then each decode step's
        if (step == n_decode) {
            break;
        }
        printf("%d%s", best, step + 1 < n_decode ? "," : "\n");
        if (llama_decode(ctx, llama_batch_get_one(&best, 1))) {
            fprintf(stderr, "decode failed\n");
            return 1;
        }
    }
    fprintf(stderr, "times ");
    for (size_t i = 0; i < times.size(); i++) {
        fprintf(stderr, "%lld%s", times[i] - times[0], i + 1 < times.size() ? "," : "\n");
    }
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
