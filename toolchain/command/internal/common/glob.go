package common

import (
	"fmt"
	"io/fs"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// globRegexp translates a glob ("*" = anything but "/", "**" = anything, "?" = one char but "/",
// "{a,b}" alternatives, "[...]" classes) to an anchored regular expression.
func globRegexp(pattern string) (*regexp.Regexp, error) {
	var b strings.Builder
	b.WriteString("^")
	depth := 0
	for i := 0; i < len(pattern); i++ {
		c := pattern[i]
		switch {
		case c == '*' && i+1 < len(pattern) && pattern[i+1] == '*':
			b.WriteString(".*")
			i++
		case c == '*':
			b.WriteString("[^/]*")
		case c == '?':
			b.WriteString("[^/]")
		case c == '{':
			depth++
			b.WriteString("(?:")
		case c == '}' && depth > 0:
			depth--
			b.WriteString(")")
		case c == ',' && depth > 0:
			b.WriteString("|")
		case c == '[':
			j := strings.IndexByte(pattern[i:], ']')
			if j < 0 {
				return nil, fmt.Errorf("glob %q: unterminated [", pattern)
			}
			class := pattern[i+1 : i+j]
			if strings.HasPrefix(class, "!") {
				class = "^" + class[1:]
			}
			b.WriteString("[" + class + "]")
			i += j
		case c == '\\' && i+1 < len(pattern):
			b.WriteString(regexp.QuoteMeta(pattern[i+1 : i+2]))
			i++
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	if depth != 0 {
		return nil, fmt.Errorf("glob %q: unterminated {", pattern)
	}
	b.WriteString("$")
	return regexp.Compile(b.String())
}

// MatchRules applies include/exclude rules (an exclude starts with "!") in order to slash-separated
// relative paths and returns the selected ones, sorted.
func MatchRules(rules []string, paths []string) ([]string, error) {
	type rule struct {
		exclude bool
		re      *regexp.Regexp
	}
	compiled := make([]rule, 0, len(rules))
	for _, r := range rules {
		ex := strings.HasPrefix(r, "!")
		re, err := globRegexp(strings.TrimPrefix(r, "!"))
		if err != nil {
			return nil, err
		}
		compiled = append(compiled, rule{ex, re})
	}
	var out []string
	for _, p := range paths {
		in := false
		for _, r := range compiled {
			if r.re.MatchString(p) {
				in = !r.exclude
			}
		}
		if in {
			out = append(out, p)
		}
	}
	sort.Strings(out)
	return out, nil
}

// GlobFiles lists the regular files under dir (relative, slash-separated) selected by rules.
func GlobFiles(dir string, rules []string) ([]string, error) {
	if len(rules) == 0 {
		return nil, nil
	}
	var all []string
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			rel, err := filepath.Rel(dir, path)
			if err != nil {
				return err
			}
			all = append(all, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return MatchRules(rules, all)
}
