// npumoe-run: greedy generation from a program `npumoe export` wrote, on ExecuTorch's C++ runtime alone (no Python,
// no torch). The program's `prefill` method takes a chunk of tokens from a start position, its `decode` method one
// token; both write one KV cache, which the methods share (exported with share_mutable_buffers, so the Module is
// opened with shared memory arenas). The program names itself in constant methods: the npumoe version and target it
// was exported by, its vocabulary, context, chunk and EOS ids.
//
//   npumoe-run DIR/model.pte --tokens 1,2,3 --max-new-tokens N --json
//   npumoe-run DIR/model.pte --prompt TEXT      (reads the tokenizer beside the program)
//
// Bad input is one line on stderr and exit code 2; a program the runtime fails to run, exit code 1.

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/platform/platform.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#ifndef NPUMOE_VERSION
#error "build with -DNPUMOE_VERSION=\"...\" (npumoe export does)"
#endif
#ifndef NPUMOE_TARGET
#error "build with -DNPUMOE_TARGET=\"...\", the export target whose backends this runner links"
#endif
// What a delegate needs before the program loads (npumoe export fills these in from the target's RunnerSetup): lines
// NAME=VALUE set where the environment has no NAME, then libraries (absolute paths, one a line) loaded globally, so
// that a backend opening them by name gets these. Empty by default: on a device they sit beside the runner
// (LD_LIBRARY_PATH, and ADSP_LIBRARY_PATH for QNN's DSP libraries).
#ifndef NPUMOE_SETENV
#define NPUMOE_SETENV ""
#endif
#ifndef NPUMOE_PRELOAD
#define NPUMOE_PRELOAD ""
#endif
// Where the target's delegate exists when this runner's ExecuTorch lacks it (e.g. Core ML's: macOS or iOS).
#ifndef NPUMOE_ELSEWHERE
#define NPUMOE_ELSEWHERE ""
#endif

namespace {

using executorch::extension::Module;
using executorch::extension::make_tensor_ptr;
using executorch::runtime::Error;
using executorch::runtime::EValue;

constexpr int kBadInput = 2;
constexpr int kRunFailed = 1;
constexpr int kByteVocabulary = 256;  // npumoe's byte-level tokenizer: token id = byte value

std::string last_runtime_error;  // ExecuTorch's own last error log line: added to ours, never printed alone

void keep_runtime_error(et_timestamp_t, et_pal_log_level_t level, const char*, const char*, size_t,
                        const char* message, size_t length) {
  if (level == kError || level == kFatal) last_runtime_error.assign(message, length);
}

[[noreturn]] void fail(int code, const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  std::exit(code);
}

[[noreturn]] void runtime_failed(const std::string& what, Error error) {
  std::string detail = last_runtime_error.empty() ? "" : ": " + last_runtime_error;
  fail(kRunFailed, what + " failed (ExecuTorch error " + std::to_string(static_cast<int>(error)) + detail + ")");
}

struct Options {
  std::string program;
  std::string tokens;
  std::string prompt;
  bool has_tokens = false, has_prompt = false, json = false, logits = false;
  long max_new_tokens = 32;
};

const char* kUsage =
    "usage: npumoe-run MODEL.pte (--tokens 1,2,3 | --prompt TEXT) [--max-new-tokens N] [--json] [--logits]";

Options parse_arguments(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail(kBadInput, arg + " needs a value; " + kUsage);
      return argv[++i];
    };
    if (arg == "--tokens") o.tokens = value(), o.has_tokens = true;
    else if (arg == "--prompt") o.prompt = value(), o.has_prompt = true;
    else if (arg == "--max-new-tokens") {
      std::string text = value();
      char* end = nullptr;
      o.max_new_tokens = std::strtol(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || o.max_new_tokens < 1)
        fail(kBadInput, "--max-new-tokens takes a whole number of at least 1, got '" + text + "'");
    } else if (arg == "--json") o.json = true;
    else if (arg == "--logits") o.logits = true;
    else if (arg == "-h" || arg == "--help") std::printf("%s\n", kUsage), std::exit(0);
    else if (!arg.empty() && arg[0] != '-' && o.program.empty()) o.program = arg;
    else fail(kBadInput, "unknown argument '" + arg + "'; " + kUsage);
  }
  if (o.program.empty()) fail(kBadInput, std::string("no program given; ") + kUsage);
  if (o.has_tokens == o.has_prompt) fail(kBadInput, std::string("give one of --tokens and --prompt; ") + kUsage);
  return o;
}

std::vector<int64_t> parse_tokens(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    char* end = nullptr;
    long long id = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0')
      fail(kBadInput, "--tokens takes integers separated by commas, got '" + text + "'");
    ids.push_back(id);
  }
  if (ids.empty()) fail(kBadInput, "--tokens is empty; give at least one token id");
  return ids;
}

std::string directory_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool readable(const std::string& path) { return std::ifstream(path).good(); }

// The value of "kind" in npumoe's tokenizer marker ({"kind": "bytes"}), or "" where there is none.
std::string marker_kind(const std::string& path) {
  std::ifstream file(path);
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  auto key = text.find("\"kind\"");
  auto colon = key == std::string::npos ? key : text.find(':', key);
  auto open = colon == std::string::npos ? colon : text.find('"', colon);
  auto close = open == std::string::npos ? open : text.find('"', open + 1);
  if (close == std::string::npos || text.find_first_not_of(" \t\r\n", colon + 1) != open) return "";
  return text.substr(open + 1, close - open - 1);
}

// The prompt's token ids from the tokenizer beside the program, refused where this runner cannot read it or its ids
// are not the program's vocabulary.
std::vector<int64_t> encode_prompt(const Options& o, int64_t vocab_size) {
  std::string dir = directory_of(o.program), marker = dir + "/npumoe_tokenizer.json";
  if (!readable(marker)) {
    std::string why = readable(dir + "/tokenizer.json") ? dir + "/tokenizer.json is a Hugging Face tokenizer, which "
                                                          "this runner does not read"
                                                        : "there is no tokenizer beside the program";
    fail(kBadInput, why + "; pass token ids with --tokens instead of --prompt");
  }
  std::string kind = marker_kind(marker);
  if (kind != "bytes") fail(kBadInput, marker + " is not npumoe's tokenizer marker ({\"kind\": \"bytes\"}); "
                                       "export the program again or pass --tokens");
  if (vocab_size != kByteVocabulary)
    fail(kBadInput, marker + " is a byte-level tokenizer (256 ids) but the program's vocabulary has " +
                        std::to_string(vocab_size) + " ids: they do not belong together; export the program again");
  if (o.prompt.empty()) fail(kBadInput, "the prompt is empty; pass --prompt TEXT (or --tokens 1,2,3)");
  std::vector<int64_t> ids;
  for (unsigned char byte : o.prompt) ids.push_back(byte);
  return ids;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream stream(text);
  for (std::string line; std::getline(stream, line);)
    if (!line.empty()) out.push_back(line);
  return out;
}

void prepare_device() {
  for (const std::string& line : lines(NPUMOE_SETENV)) {
    auto equals = line.find('=');
    setenv(line.substr(0, equals).c_str(), line.substr(equals + 1).c_str(), /*overwrite=*/0);
  }
  for (const std::string& library : lines(NPUMOE_PRELOAD)) {
    if (!dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL))
      fail(kRunFailed, "cannot load " + library + " (" + dlerror() + "), which the " NPUMOE_TARGET " delegate needs; "
                       "export the program again on this machine (npumoe export rebuilds the runner)");
  }
}

// Device libraries may print to stdout as they load and run (QNN's x86 HTP simulator does): until the results, the
// runner's stdout goes to stderr, so that what it prints (--json) is all that is on stdout.
class QuietStdout {
 public:
  QuietStdout() : saved_(dup(STDOUT_FILENO)) { std::fflush(stdout), dup2(STDERR_FILENO, STDOUT_FILENO); }
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stdout), dup2(saved_, STDOUT_FILENO), close(saved_);
    saved_ = -1;
  }

 private:
  int saved_;
};

class Program {
 public:
  explicit Program(const std::string& path)
      : module_(path, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, /*share_memory_arenas=*/true) {
    if (!readable(path)) fail(kBadInput, "cannot read the program " + path);
    Error error = module_.load();
    if (error != Error::Ok)
      fail(kBadInput, path + " is not an ExecuTorch program this runtime can load (error " +
                          std::to_string(static_cast<int>(error)) + "); export it again with npumoe export");
    auto names = module_.method_names();
    if (!names.ok() || !names->count("npumoe_version"))
      fail(kBadInput, path + " is not a program npumoe export wrote (it has no npumoe_version method)");
    std::string version = text("npumoe_version"), target = text("npumoe_target");
    if (version != NPUMOE_VERSION)
      fail(kBadInput, path + " was exported by npumoe " + version + ", this runner is npumoe " NPUMOE_VERSION
                           "'s; export it again with this npumoe (npumoe export), or run it with the runner beside it");
    if (target != NPUMOE_TARGET)
      fail(kBadInput, path + " was exported for target " + target + ", this runner runs target " NPUMOE_TARGET
                           " programs; use the npumoe-run that npumoe export wrote beside it");
    for (const char* method : {"npumoe_chunk", "get_vocab_size", "get_max_context_len", "get_eos_ids", "prefill",
                               "decode"}) {
      if (!names->count(method))
        fail(kBadInput, path + " lacks the method " + method + " an npumoe program has; export it again");
    }
    vocab_size = integer("get_vocab_size");
    max_context = integer("get_max_context_len");
    chunk = integer("npumoe_chunk");
    for (const EValue& id : constant("get_eos_ids")) eos.push_back(id.toInt());
    share_xnnpack_weights();
    for (const char* method : {"prefill", "decode"}) {
      check_delegates(path, method);
      if ((error = module_.load_method(method)) != Error::Ok) runtime_failed(std::string("loading ") + method, error);
    }
  }

  // Logits [vocab] of the last of ``ids`` after prefilling them, chunk by chunk, into the empty cache.
  std::vector<float> prefill(const std::vector<int64_t>& ids) {
    std::vector<float> logits;
    for (size_t start = 0; start < ids.size(); start += chunk) {
      size_t valid = std::min<size_t>(chunk, ids.size() - start);
      std::vector<int64_t> piece(ids.begin() + start, ids.begin() + start + valid);
      piece.resize(chunk, 0);
      logits = run("prefill", {make_tensor_ptr({static_cast<int>(chunk)}, std::move(piece)),
                               make_tensor_ptr(std::vector<int64_t>{static_cast<int64_t>(start)}),
                               make_tensor_ptr(std::vector<int64_t>{static_cast<int64_t>(valid)})});
    }
    return logits;
  }

  std::vector<float> decode(int64_t token, int64_t position) {
    return run("decode",
               {make_tensor_ptr(std::vector<int64_t>{token}), make_tensor_ptr(std::vector<int64_t>{position})});
  }

  int64_t vocab_size = 0, max_context = 0, chunk = 0;
  int64_t padded = 0, spilled = 0;  // over the prefill, as npumoe's engine counts them (nothing is dropped)
  std::vector<int64_t> eos;

 private:
  std::vector<float> run(const char* method, const std::vector<executorch::extension::TensorPtr>& inputs) {
    std::vector<EValue> values(inputs.begin(), inputs.end());
    auto out = module_.execute(method, values);
    if (!out.ok()) runtime_failed(std::string("running ") + method, out.error());
    if (out->size() > 1) {  // prefill's MoE tally: [padded rows, spilled pairs] of this chunk
      const int64_t* tally = out->at(1).toTensor().const_data_ptr<int64_t>();
      padded += tally[0], spilled += tally[1];
    }
    const auto& tensor = out->at(0).toTensor();
    const float* data = tensor.const_data_ptr<float>();
    return std::vector<float>(data, data + tensor.numel());  // (copied: the next call reuses the shared arena)
  }

  // XNNPACK packs every float weight it multiplies, by default once per method that uses it (the LM head of an
  // experts-only int4 program: a packed fp32 copy for prefill and another for decode). Its weights cache keys the
  // packed copy by the weight's named data, which the program stores once for both methods, so both share one.
  static void share_xnnpack_weights() {
    constexpr char kXnnpack[] = "XnnpackBackend";
    if (!executorch::runtime::get_backend_class(kXnnpack)) return;  // a target without XNNPACK
    executorch::runtime::BackendOptions<1> options;
    options.set_option("weight_cache_enabled", true);
    Error error = executorch::runtime::set_option(kXnnpack, options.view());
    if (error != Error::Ok) runtime_failed("enabling XNNPACK's weights cache", error);
  }

  // Every delegate the method uses is registered here; else one line saying where the program runs.
  void check_delegates(const std::string& path, const char* method) {
    auto meta = module_.method_meta(method);
    if (!meta.ok()) runtime_failed(std::string("reading ") + method, meta.error());
    for (size_t i = 0; i < meta->num_backends(); ++i) {
      auto name = meta->get_backend_name(i);
      if (!name.ok() || executorch::runtime::get_backend_class(*name)) continue;
      const std::string where(NPUMOE_ELSEWHERE);
      fail(kBadInput, path + "'s " + method + " runs on ExecuTorch's " + *name + " delegate, which this runtime lacks; " +
                          (where.empty() ? "export the program again on this machine"
                                         : "it runs only on " + where + " (build npumoe-run there)"));
    }
  }

  std::vector<EValue> constant(const char* method) {
    auto out = module_.execute(method);
    if (!out.ok()) runtime_failed(std::string("reading ") + method, out.error());
    return *out;
  }

  std::string text(const char* method) {
    auto values = constant(method);
    if (values.size() != 1 || !values[0].isString()) fail(kBadInput, std::string(method) + " is not a string");
    return std::string(values[0].toString());
  }

  int64_t integer(const char* method) {
    auto values = constant(method);
    if (values.size() != 1 || !values[0].isInt()) fail(kBadInput, std::string(method) + " is not an integer");
    return values[0].toInt();
  }

  Module module_;
};

int64_t argmax(const std::vector<float>& logits) {
  return std::max_element(logits.begin(), logits.end()) - logits.begin();  // the first of equal maxima, as torch
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void print_json(const std::vector<int64_t>& tokens, double prefill_tok_s, double decode_tok_s, size_t steps,
                const Program& program, const std::vector<std::vector<float>>& logits) {
  std::printf("{\"tokens\": [");
  for (size_t i = 0; i < tokens.size(); ++i) std::printf("%s%" PRId64, i ? ", " : "", tokens[i]);
  std::printf("], \"prefill_tok_s\": %.6g, \"decode_tok_s\": ", prefill_tok_s);
  steps ? std::printf("%.6g", decode_tok_s) : std::printf("null");
  std::printf(", \"prefill_moe\": {\"padded\": %" PRId64 ", \"spilled\": %" PRId64 ", \"dropped\": 0}",
              program.padded, program.spilled);
  if (!logits.empty()) {
    std::printf(", \"logits\": [");
    for (size_t i = 0; i < logits.size(); ++i) {
      std::printf("%s[", i ? ", " : "");
      for (size_t j = 0; j < logits[i].size(); ++j) std::printf("%s%.9g", j ? ", " : "", logits[i][j]);
      std::printf("]");
    }
    std::printf("]");
  }
  std::printf("}\n");
}

}  // namespace

int main(int argc, char** argv) {
  executorch::runtime::register_pal(executorch::runtime::PalImpl::create(keep_runtime_error, __FILE__));
  Options o = parse_arguments(argc, argv);
  QuietStdout quiet;
  prepare_device();
  Program program(o.program);
  std::vector<int64_t> ids = o.has_tokens ? parse_tokens(o.tokens) : encode_prompt(o, program.vocab_size);
  for (int64_t id : ids) {
    if (id < 0 || id >= program.vocab_size)
      fail(kBadInput, "token id " + std::to_string(id) + " is outside the program's vocabulary [0, " +
                          std::to_string(program.vocab_size) + ")");
  }
  if (static_cast<int64_t>(ids.size()) + o.max_new_tokens > program.max_context)
    fail(kBadInput, "the prompt (" + std::to_string(ids.size()) + " tokens) plus " +
                        std::to_string(o.max_new_tokens) + " new tokens exceeds the program's context of " +
                        std::to_string(program.max_context) + "; shorten the prompt or export with a larger "
                        "--max-context");

  auto begin = std::chrono::steady_clock::now();
  std::vector<float> logits = program.prefill(ids);
  double prefill_seconds = seconds_since(begin);
  std::vector<int64_t> tokens = ids;
  std::vector<std::vector<float>> seen;
  begin = std::chrono::steady_clock::now();
  for (long n = 0;; ++n) {
    if (o.logits) seen.push_back(logits);
    int64_t token = argmax(logits);
    tokens.push_back(token);
    bool eos = std::find(program.eos.begin(), program.eos.end(), token) != program.eos.end();
    if (eos || n + 1 == o.max_new_tokens) break;
    logits = program.decode(token, static_cast<int64_t>(tokens.size()) - 1);
  }
  double decode_seconds = seconds_since(begin);
  size_t steps = tokens.size() - ids.size() - 1;  // the first new token comes from the prefill's logits
  quiet.restore();
  if (o.json) {
    print_json(tokens, ids.size() / prefill_seconds, steps / decode_seconds, steps, program, seen);
  } else if (o.has_prompt) {
    for (size_t i = ids.size(); i < tokens.size(); ++i) std::putchar(static_cast<int>(tokens[i]));  // byte ids
    std::putchar('\n');
  } else {
    for (size_t i = ids.size(); i < tokens.size(); ++i) std::printf("%s%" PRId64, i > ids.size() ? "," : "", tokens[i]);
    std::printf("\n");
  }
  return 0;
}
