// Serves an embshard package (embshard_kernels.serving.package_for_serving) without Python.
//
//   serve_package PACKAGE INPUTS OUTPUTS LIBRARY...
//
// Loads each LIBRARY first (FBGEMM's operator libraries, in the order
// embshard_kernels.serving.fbgemm_libraries() lists them), then the package, and gives it its
// constants viewed in one mapping of the package file (the records its manifest,
// embshard_kernels.serving_constants.MANIFEST, lists; nothing is copied); INPUTS is a file
// written by Python's torch.save of a list of requests, each the list of the model's input
// tensors flattened as the package takes them (for a KeyedJaggedTensor: values, [weights,]
// lengths); OUTPUTS receives the list of each request's flattened outputs, for torch.load.
#include <dlfcn.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>
#include <torch/torch.h>

namespace {

const char* const kManifest = "data/embshard/constants.tsv";
const char* const kRecords = "data/embshard/constants/";

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, separator);) {
    parts.push_back(part);
  }
  return parts;
}

std::vector<int64_t> integers(const std::string& text) {
  std::vector<int64_t> values;
  for (const std::string& part : split(text, ',')) {
    values.push_back(std::stoll(part));
  }
  return values;
}

at::ScalarType dtype_named(const std::string& name) {
  static const std::map<std::string, at::ScalarType> dtypes = {
      {"float32", at::kFloat}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16},
      {"float64", at::kDouble}, {"uint8", at::kByte}, {"int8", at::kChar},
      {"int32", at::kInt}, {"int64", at::kLong}, {"bool", at::kBool}};
  auto found = dtypes.find(name);
  TORCH_CHECK(found != dtypes.end(), "serve_package: constants of dtype ", name, " are not supported");
  return found->second;
}

// The package's constants, each a view of one mapping of the package file (or, for a constant
// of an accelerator, its copy there); empty for a package without a manifest.
std::unordered_map<std::string, at::Tensor> map_constants(const std::string& path) {
  std::unordered_map<std::string, at::Tensor> constants;
  caffe2::serialize::PyTorchStreamReader reader(path);
  if (!reader.hasRecord(kManifest)) {
    return constants;
  }
  auto [data, size] = reader.getRecord(kManifest);
  std::string manifest(static_cast<const char*>(data.get()), size);
  auto bytes = static_cast<int64_t>(std::filesystem::file_size(path));
  at::Tensor file = at::from_file(path, /*shared=*/false, bytes, at::TensorOptions(at::kByte));
  for (const std::string& line : split(manifest, '\n')) {
    std::vector<std::string> f = split(line, '\t');
    TORCH_CHECK(f.size() == 7, "serve_package: bad manifest line: ", line);
    at::ScalarType dtype = dtype_named(f[2]);
    auto start = static_cast<int64_t>(reader.getRecordOffset(kRecords + f[1]));
    int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK(start % item == 0, "serve_package: ", f[0], " is not aligned to its dtype");
    at::Tensor view = at::empty({0}, at::TensorOptions(dtype))
                          .set_(file.storage(), start / item + std::stoll(f[6]), integers(f[4]),
                                integers(f[5]));
    constants[f[0]] = f[3] == "cpu" ? view : view.to(c10::Device(f[3]));
  }
  return constants;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: serve_package PACKAGE INPUTS OUTPUTS LIBRARY...\n";
    return 2;
  }
  for (int i = 4; i < argc; ++i) {
    if (dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::cerr << "serve_package: cannot load " << argv[i] << ": " << dlerror() << "\n";
      return 2;
    }
  }
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  std::unordered_map<std::string, at::Tensor> constants = map_constants(argv[1]);
  if (!constants.empty()) {  // user-managed: they outlive every run below
    loader.load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true,
                          /*user_managed=*/true);
  }
  c10::InferenceMode inference;
  c10::IValue requests = torch::pickle_load(read_file(argv[2]));
  c10::impl::GenericList replies(c10::AnyType::get());
  for (const c10::IValue& request : requests.toListRef()) {
    std::vector<at::Tensor> inputs;
    for (const c10::IValue& tensor : request.toListRef()) {
      inputs.push_back(tensor.toTensor());
    }
    std::vector<at::Tensor> outputs = loader.run(inputs);
    replies.push_back(c10::IValue(c10::List<at::Tensor>(outputs)));
  }
  std::vector<char> bytes = torch::pickle_save(c10::IValue(replies));
  std::ofstream(argv[3], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::cout << "served " << requests.toListRef().size() << " requests\n";
  return 0;
}
