// anima-ui's native VAE decoder: a C entry point around stable-diffusion.cpp's WAN::WanVAERunner
// (decode only, Qwen-Image version). sd.cpp has no latent-in API, so this file builds the runner and
// loads the weights the way StableDiffusionGGML::init does for a `--vae` file.
//
// Latent layout: a C-contiguous float32 [1, 16, h, w] array in MODEL space (the sampler's space).
// Output: uint8 RGB, row-major [H, W, 3] with H = 8h, W = 8w.

#include <cstdint>
#include <cstring>
#include <map>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "ggml_extend.hpp"
#include "model.h"
#include "stable-diffusion.h"
#include "wan.hpp"

namespace {

// sd.cpp's loader logs from its worker threads, so the error text is shared and locked
std::mutex error_mutex;
std::string last_error;

void set_error(const std::string& text) {
    std::lock_guard<std::mutex> lock(error_mutex);
    last_error = text;
}

// sd.cpp logs through a global callback; the first error of a call is kept for anima_vae_last_error()
// (it names the tensor; later ones only say that loading failed). Warnings and errors go to stderr,
// the rest only when ANIMA_VAE_VERBOSE is set (sd.cpp is chatty at INFO level).
void log_to_stderr(enum sd_log_level_t level, const char* text, void*) {
    if (level == SD_LOG_ERROR) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (last_error.empty()) {
            last_error = text;
        }
    }
    if (level >= SD_LOG_WARN || std::getenv("ANIMA_VAE_VERBOSE") != nullptr) {
        fputs(text, stderr);
    }
}

// sd.cpp draws a progress bar on stdout unless a progress callback is set.
void ignore_progress(int, int, float, void*) {}

struct AnimaVae {
    ggml_backend_t backend = nullptr;
    std::shared_ptr<WAN::WanVAERunner> runner;
    int threads = 1;

    ~AnimaVae() {
        runner.reset();
        if (backend != nullptr) {
            ggml_backend_free(backend);
        }
    }
};

// ggml's CPU backend asks this between graph nodes; a non-zero flag ends the compute (the decode then fails, and
// the caller, which set the flag, reports a cancellation). Stop during the final decode takes effect within a node.
bool cancel_requested(void* flag) {
    return __atomic_load_n(static_cast<const int*>(flag), __ATOMIC_RELAXED) != 0;
}

uint8_t float_to_u8(float value) {  // same rounding as sd.cpp's preprocessing_float_to_u8
    if (value <= 0.0f) {
        return 0;
    }
    if (value >= 1.0f) {
        return 255;
    }
    return static_cast<uint8_t>(value * 255.0f + 0.5f);
}

}  // namespace

extern "C" {

const char* anima_vae_last_error() {
    std::lock_guard<std::mutex> lock(error_mutex);
    return last_error.c_str();
}

// weight_type: an sd_type_t (SD_TYPE_F32 = 0, SD_TYPE_F16 = 1, SD_TYPE_BF16 = 30) to convert the
// weights to at load, or -1 to keep them as stored. sd.cpp 0.4.7 creates every CausalConv3d weight
// as F16 whatever the file holds; the type applies to the other layers (2-D resample convs,
// attention projections).
void* anima_vae_load(const char* path, int threads, int weight_type) {
    set_error("");
    sd_set_log_callback(log_to_stderr, nullptr);
    sd_set_progress_callback(ignore_progress, nullptr);

    ModelLoader loader;
    if (!loader.init_from_file(path, "vae.")) {
        set_error(std::string("cannot read VAE file ") + path);
        return nullptr;
    }
    loader.convert_tensors_name();  // vae.decoder.* -> first_stage_model.decoder.*
    if (weight_type >= 0) {
        loader.set_wtype_override(static_cast<ggml_type>(weight_type));
    }

    auto vae     = std::make_unique<AnimaVae>();
    vae->threads = threads > 0 ? threads : sd_get_num_physical_cores();
    vae->backend = ggml_backend_cpu_init();
    vae->runner  = std::make_shared<WAN::WanVAERunner>(vae->backend,
                                                      false,
                                                      loader.get_tensor_storage_map(),
                                                      "first_stage_model",
                                                      true,
                                                      VERSION_QWEN_IMAGE);
    if (!vae->runner->alloc_params_buffer()) {
        set_error("cannot allocate the VAE weights");
        return nullptr;
    }
    std::map<std::string, ggml_tensor*> tensors;
    vae->runner->get_param_tensors(tensors, "first_stage_model");

    // decode-only: the encoder half of the file is skipped, as in StableDiffusionGGML::init
    std::set<std::string> ignore = {"first_stage_model.encoder", "first_stage_model.conv1"};
    if (!loader.load_tensors(tensors, ignore, vae->threads, false)) {
        if (last_error.empty()) {
            last_error = "loading the VAE tensors failed (missing or misshapen keys)";
        }
        return nullptr;
    }
    return vae.release();
}

// Returns 0 on success. tile is in latent pixels, overlap a fraction (sd.cpp clamps it to [0, 0.5]).
int anima_vae_decode(void* handle, const float* latent, int w, int h, int tiled, int tile, float overlap,
                     uint8_t* out_rgb) {
    set_error("");
    auto* vae = static_cast<AnimaVae*>(handle);

    // ggml order [W, H, C, N] is the memory order of a C-contiguous [N, C, H, W] array
    sd::Tensor<float> model_space({w, h, 16, 1});
    std::memcpy(model_space.data(), latent, sizeof(float) * static_cast<size_t>(w) * h * 16);

    // the one model-space -> VAE-space conversion (what decode_first_stage does before decoding)
    sd::Tensor<float> vae_space = vae->runner->diffusion_to_vae_latents(model_space);

    sd_tiling_params_t tiling = {tiled != 0, tile, tile, overlap, 0.0f, 0.0f};
    sd::Tensor<float> rgb     = vae->runner->decode(vae->threads, vae_space, tiling, false, false, false, true);
    if (rgb.empty()) {
        if (last_error.empty()) {
            last_error = "VAE decode failed";
        }
        return 1;
    }

    // rgb is [W*8, H*8, 3, 1] in [0, 1] (decode() already applied clamp((x + 1) / 2))
    const int64_t width = rgb.shape()[0], height = rgb.shape()[1];
    const int64_t plane = width * height;
    const float* data   = rgb.data();
    for (int64_t i = 0; i < plane; ++i) {
        for (int c = 0; c < 3; ++c) {
            out_rgb[i * 3 + c] = float_to_u8(data[c * plane + i]);
        }
    }
    return 0;
}

// flag: an int the caller sets to non-zero (from any thread) to stop a running decode; nullptr: nothing stops it.
void anima_vae_set_cancel(void* handle, const int* flag) {
    auto* vae = static_cast<AnimaVae*>(handle);
    ggml_backend_cpu_set_abort_callback(vae->backend, flag != nullptr ? cancel_requested : nullptr,
                                        const_cast<int*>(flag));
}

void anima_vae_free(void* handle) {
    delete static_cast<AnimaVae*>(handle);
}

}  // extern "C"
