// strata's C entry to llama.cpp's JSON-schema-to-grammar converter
// (common/json-schema-to-grammar.cpp of vendor/llama-common.tar.xz), and the
// three string helpers of common.cpp that the converter calls (common.cpp
// itself pulls in llama.cpp's sampling, fitting and build info).

#include "json-schema-to-grammar.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

std::string string_join(const std::vector<std::string> & values, const std::string & separator) {
    std::string out;
    for (size_t i = 0; i < values.size(); ++i) {
        if (i > 0) {
            out += separator;
        }
        out += values[i];
    }
    return out;
}

std::vector<std::string> string_split(const std::string & str, const std::string & delimiter) {
    std::vector<std::string> parts;
    if (delimiter.empty()) {
        parts.push_back(str);
        return parts;
    }
    size_t start = 0;
    for (size_t at; (at = str.find(delimiter, start)) != std::string::npos; start = at + delimiter.size()) {
        parts.push_back(str.substr(start, at - start));
    }
    parts.push_back(str.substr(start));
    return parts;
}

std::string string_repeat(const std::string & str, size_t n) {
    std::string out;
    out.reserve(str.size() * n);
    for (size_t i = 0; i < n; ++i) {
        out += str;
    }
    return out;
}

static char * dup(const std::string & s) {
    char * p = static_cast<char *>(std::malloc(s.size() + 1));
    if (p != nullptr) {
        std::memcpy(p, s.c_str(), s.size() + 1);
    }
    return p;
}

// Converts the JSON schema `schema` (NUL-terminated UTF-8) to a GBNF grammar
// whose root rule is "root". Returns 0 and the grammar in *out, or 1 and the
// error text in *out (*out NULL when out of memory); the caller frees *out
// with strata_json_schema_free.
extern "C" int strata_json_schema_to_grammar(const char * schema, char ** out) {
    try {
        *out = dup(json_schema_to_grammar(common_json::parse(schema)));
        return 0;
    } catch (const std::exception & e) {
        *out = dup(e.what());
        return 1;
    } catch (...) {
        *out = dup("unknown error");
        return 1;
    }
}

extern "C" void strata_json_schema_free(char * p) {
    std::free(p);
}
