#include "remote/aws_credentials.hpp"

#include <cstdlib>
#include <fstream>
#include <map>

namespace ckptfs {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}

// The key = value pairs of section `section` of an INI file; false when the file cannot be
// read (absent is not an error for the caller).
bool ReadIniSection(const std::string& path, const std::string& section, std::map<std::string, std::string>* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line, current;
  while (std::getline(in, line)) {
    line = Trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      current = Trim(line.substr(1, line.size() - 2));
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string::npos || current != section) continue;
    (*out)[Trim(line.substr(0, eq))] = Trim(line.substr(eq + 1));
  }
  return true;
}

std::string HomeFile(const char* relative) {
  const std::string home = Env("HOME");
  return home.empty() ? std::string() : home + "/" + relative;
}

}  // namespace

Status LoadS3Settings(S3Settings* out) {
  *out = S3Settings{};
  const std::string profile = Env("AWS_PROFILE").empty() ? "default" : Env("AWS_PROFILE");
  AwsSigning& s = out->signing;
  s.access_key_id = Env("AWS_ACCESS_KEY_ID");
  s.secret_access_key = Env("AWS_SECRET_ACCESS_KEY");
  s.session_token = Env("AWS_SESSION_TOKEN");
  if (s.access_key_id.empty() != s.secret_access_key.empty())
    return Status::InvalidArgument("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together");
  if (s.access_key_id.empty()) {
    const std::string file = Env("AWS_SHARED_CREDENTIALS_FILE").empty() ? HomeFile(".aws/credentials")
                                                                         : Env("AWS_SHARED_CREDENTIALS_FILE");
    std::map<std::string, std::string> values;
    if (!file.empty() && ReadIniSection(file, profile, &values)) {
      s.access_key_id = values["aws_access_key_id"];
      s.secret_access_key = values["aws_secret_access_key"];
      s.session_token = values["aws_session_token"];
      if (s.access_key_id.empty() != s.secret_access_key.empty())
        return Status::InvalidArgument(file, "profile [" + profile +
                                                 "] needs both aws_access_key_id and aws_secret_access_key");
    } else if (!Env("AWS_PROFILE").empty()) {
      return Status::InvalidArgument(file.empty() ? "AWS_PROFILE" : file, "no credentials for profile " + profile);
    }
  }
  s.region = Env("AWS_REGION");
  if (s.region.empty()) s.region = Env("AWS_DEFAULT_REGION");
  if (s.region.empty()) {
    const std::string config = Env("AWS_CONFIG_FILE").empty() ? HomeFile(".aws/config") : Env("AWS_CONFIG_FILE");
    std::map<std::string, std::string> values;
    if (!config.empty() && ReadIniSection(config, profile == "default" ? "default" : "profile " + profile, &values))
      s.region = values["region"];
  }
  if (s.region.empty()) s.region = "us-east-1";
  out->endpoint = Env("AWS_ENDPOINT_URL_S3");
  if (out->endpoint.empty()) out->endpoint = Env("AWS_ENDPOINT_URL");
  while (!out->endpoint.empty() && out->endpoint.back() == '/') out->endpoint.pop_back();
  return Status::OK();
}

}  // namespace ckptfs
