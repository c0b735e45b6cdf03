//! No import circles inside any crate of the workspace.
//!
//! Reads every crate's source (from `src/lib.rs` and `src/main.rs` through its `mod`
//! declarations) and draws an arrow from a file to each file of the same crate it names:
//! `use crate::…`, `use super::…`, a path `crate::…`/`super::…`/`self::…` in the code, or a
//! path through a child module it declares. Code under `#[cfg(test)]` is left out (a
//! test module looks at its parent by design). Two pictures must have no circle:
//!
//! - files: no file reaches itself through the arrows, but for the arrows from a module
//!   to one that contains it (`super::Thing`, `crate::RESYNC_INTERVAL`): a parent
//!   declares what its children share and uses them, the one loop Rust's modules are
//!   built for;
//! - modules: with each file counted as its top-level module (`request/exec.rs` is
//!   `request`), no two top-level modules of a crate reach each other. The crate root
//!   (`lib.rs`, `main.rs`) is left out of this one: it declares and starts everything.
//!
//! On failure the message names every circle with the arrows that make it (file:line
//! and the path), so it can be cut where it is.

use slotpool_tests::workspace_root;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[test]
fn no_crate_has_an_import_circle() {
    let mut report = String::new();
    let mut counted = Vec::new();
    for root in crate_roots(workspace_root()) {
        let graph = Graph::read(&root);
        let files = graph.file_circles();
        let modules = graph.module_circles();
        counted.push(format!(
            "{}: {} files, {} arrows, {} file circles ({} counting arrows up to a parent), \
             {} module circles",
            rel(&root),
            graph.files.len(),
            graph.arrows.len(),
            files.len(),
            graph.strict_file_circles().len(),
            modules.len()
        ));
        for circle in files {
            report.push_str(&format!("files circle in {}:\n", rel(&root)));
            let arrows = graph
                .arrows
                .iter()
                .filter(|((a, b), _)| !graph.is_upward(a, b))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for (from, to) in circle_arrows(&circle, &arrows, |f| f.clone()) {
                report.push_str(&graph.describe(|f| f == &from, |f| f == &to));
            }
        }
        for circle in modules {
            report.push_str(&format!(
                "modules circle in {}: {}\n",
                rel(&root),
                circle.iter().cloned().collect::<Vec<_>>().join(" <-> ")
            ));
            let top = |f: &PathBuf| graph.top_module(f);
            for (from, to) in circle_arrows(&circle, &graph.arrows, top) {
                report.push_str(&graph.describe(
                    |f| graph.top_module(f) == from,
                    |f| graph.top_module(f) == to,
                ));
            }
        }
    }
    println!("{}", counted.join("\n"));
    assert!(report.is_empty(), "import circles:\n{report}");
}

/// The checker itself: a circle it must find, through `super`, a child module and a
/// grouped `use`, and code under `#[cfg(test)]` it must not count.
#[test]
fn the_checker_finds_a_circle_and_passes_over_tests() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("a")).unwrap();
    let write = |p: &str, text: &str| std::fs::write(src.join(p), text).unwrap();
    write(
        "lib.rs",
        "mod a;\nmod b;\nmod c;\npub fn run() { a::go(); }\n",
    );
    write("a/mod.rs", "mod inner;\npub fn go() { inner::x(); }\n");
    write(
        "a/inner.rs",
        "use crate::{b::{self, B}, c};\npub fn x() { let s = \"crate::c::no\"; }\n",
    );
    write("b.rs", "pub struct B;\npub fn f() { super::a::go() }\n");
    write(
        "c.rs",
        "// crate::a::go in a comment\n#[cfg(test)]\nmod tests { use crate::a; }\n",
    );
    let graph = Graph::read(&src.join("lib.rs"));
    let named = |v: Vec<BTreeSet<PathBuf>>| -> Vec<Vec<String>> {
        v.into_iter()
            .map(|c| c.iter().map(|f| graph.short(f)).collect())
            .collect()
    };
    assert_eq!(
        named(graph.file_circles()),
        vec![vec!["a/inner.rs", "a/mod.rs", "b.rs"]]
    );
    assert_eq!(
        graph.module_circles(),
        vec![BTreeSet::from(["a".into(), "b".into()])]
    );
    assert!(
        !graph
            .arrows
            .keys()
            .any(|(from, _)| graph.short(from) == "c.rs"),
        "c.rs's test module and comment are not arrows: {:?}",
        graph.arrows
    );
}

fn rel(p: &Path) -> String {
    p.strip_prefix(workspace_root())
        .unwrap_or(p)
        .display()
        .to_string()
}

/// Every crate root of the workspace's members: `<member>/src/lib.rs` and `main.rs`.
fn crate_roots(workspace: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    let mut members: Vec<_> = std::fs::read_dir(workspace)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .collect();
    members.sort();
    for member in members {
        for root in ["src/lib.rs", "src/main.rs"] {
            if member.join(root).is_file() {
                roots.push(member.join(root));
            }
        }
    }
    assert!(roots.len() >= 8, "crate roots found: {roots:?}");
    roots
}

/// One arrow's evidence: where a file names another.
#[derive(Debug, Clone)]
struct Seen {
    line: usize,
    path: String,
}

#[derive(Debug, Default)]
struct Graph {
    base: PathBuf,
    /// Module path (`["request", "plan"]`) of each file.
    files: BTreeMap<PathBuf, Vec<String>>,
    modules: BTreeMap<Vec<String>, PathBuf>,
    /// Per file, the names it takes from other crates (`use slotpool_config as config;`).
    foreign: BTreeMap<PathBuf, BTreeSet<String>>,
    arrows: BTreeMap<(PathBuf, PathBuf), Vec<Seen>>,
}

impl Graph {
    fn read(root: &Path) -> Graph {
        let mut graph = Graph {
            base: root.parent().unwrap().to_path_buf(),
            ..Graph::default()
        };
        let mut parsed = BTreeMap::new();
        let mut todo = vec![(root.to_path_buf(), Vec::<String>::new())];
        while let Some((file, module)) = todo.pop() {
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            let tokens = without_tests(tokens(&text));
            let children = child_modules(&tokens);
            let dir = module_dir(&file);
            for child in &children {
                let candidates = [
                    dir.join(format!("{child}.rs")),
                    dir.join(child).join("mod.rs"),
                ];
                let found = candidates.into_iter().find(|c| c.is_file());
                let found = found
                    .unwrap_or_else(|| panic!("module {child} of {} has no file", file.display()));
                let mut path = module.clone();
                path.push(child.clone());
                todo.push((found, path));
            }
            graph.files.insert(file.clone(), module.clone());
            graph.modules.insert(module.clone(), file.clone());
            graph
                .foreign
                .insert(file.clone(), foreign_names(&tokens, &children));
            parsed.insert(file, (module, tokens, children));
        }
        for (file, (module, tokens, children)) in &parsed {
            for (line, segments) in named_paths(tokens, children) {
                if let Some(target) = graph.resolve(module, &segments) {
                    if &target != file {
                        graph
                            .arrows
                            .entry((file.clone(), target))
                            .or_default()
                            .push(Seen {
                                line,
                                path: segments.join("::"),
                            });
                    }
                }
            }
        }
        graph
    }

    /// The file a path names from `module`, or None when it leaves the crate or names
    /// something a crate root re-exports from another crate (`use slotpool_config as
    /// config`).
    fn resolve(&self, module: &[String], segments: &[String]) -> Option<PathBuf> {
        let mut at: Vec<String> = module.to_vec();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                at.clear();
                rest = &rest[1..];
            }
            Some("self") => rest = &rest[1..],
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    at.pop()?;
                    rest = &rest[1..];
                }
            }
            _ => {}
        }
        let mut rest = rest.iter();
        let mut item = None;
        for seg in rest.by_ref() {
            let mut next = at.clone();
            next.push(seg.clone());
            if self.modules.contains_key(&next) {
                at = next;
            } else {
                item = Some(seg);
                break;
            }
        }
        let file = self.modules.get(&at)?.clone();
        // A name the file takes from another crate is no arrow to that file.
        match item {
            Some(name) if self.foreign[&file].contains(name) => None,
            _ => Some(file),
        }
    }

    fn short(&self, f: &Path) -> String {
        f.strip_prefix(&self.base)
            .unwrap_or(f)
            .display()
            .to_string()
    }

    /// The top-level module a file belongs to, or "" for the crate root.
    fn top_module(&self, f: &PathBuf) -> String {
        self.files[f].first().cloned().unwrap_or_default()
    }

    fn file_circles(&self) -> Vec<BTreeSet<PathBuf>> {
        let edges: BTreeSet<(PathBuf, PathBuf)> = self
            .arrows
            .keys()
            .filter(|(a, b)| !self.is_upward(a, b))
            .cloned()
            .collect();
        circles(&edges)
    }

    /// The circles counting every arrow, up to a parent too (reported, not refused).
    fn strict_file_circles(&self) -> Vec<BTreeSet<PathBuf>> {
        circles(&self.arrows.keys().cloned().collect())
    }

    /// Whether `to` is a module that contains `from`.
    fn is_upward(&self, from: &PathBuf, to: &PathBuf) -> bool {
        let (from, to) = (&self.files[from], &self.files[to]);
        to.len() < from.len() && from.starts_with(to)
    }

    fn module_circles(&self) -> Vec<BTreeSet<String>> {
        let edges: BTreeSet<(String, String)> = self
            .arrows
            .keys()
            .map(|(a, b)| (self.top_module(a), self.top_module(b)))
            .filter(|(a, b)| a != b && !a.is_empty() && !b.is_empty())
            .collect();
        circles(&edges)
    }

    /// The arrows between the files `from` and `to` pick, with where each is seen.
    fn describe(
        &self,
        in_from: impl Fn(&PathBuf) -> bool,
        in_to: impl Fn(&PathBuf) -> bool,
    ) -> String {
        let mut out = String::new();
        for ((a, b), seen) in &self.arrows {
            if in_from(a) && in_to(b) {
                let places: Vec<String> = seen
                    .iter()
                    .map(|s| format!("{}:{} {}", self.short(a), s.line, s.path))
                    .collect();
                out.push_str(&format!(
                    "  {} -> {}: {}\n",
                    self.short(a),
                    self.short(b),
                    places.join(", ")
                ));
            }
        }
        out
    }
}

/// The pairs of a circle's members that have an arrow between them (at the level `key`
/// maps files to).
fn circle_arrows<K: Ord + Clone>(
    circle: &BTreeSet<K>,
    arrows: &BTreeMap<(PathBuf, PathBuf), Vec<Seen>>,
    key: impl Fn(&PathBuf) -> K,
) -> BTreeSet<(K, K)> {
    arrows
        .keys()
        .map(|(a, b)| (key(a), key(b)))
        .filter(|(a, b)| a != b && circle.contains(a) && circle.contains(b))
        .collect()
}

/// The strongly connected components of more than one node (Tarjan).
fn circles<N: Ord + Clone>(edges: &BTreeSet<(N, N)>) -> Vec<BTreeSet<N>> {
    let nodes: BTreeSet<N> = edges
        .iter()
        .flat_map(|(a, b)| [a.clone(), b.clone()])
        .collect();
    let nodes: Vec<N> = nodes.into_iter().collect();
    let index_of = |n: &N| nodes.binary_search(n).unwrap();
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (a, b) in edges {
        next[index_of(a)].push(index_of(b));
    }
    struct Tarjan<'a> {
        next: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        counter: usize,
        found: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.counter);
            self.low[v] = self.counter;
            self.counter += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for &w in &self.next[v] {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.found.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        next: &next,
        index: vec![None; nodes.len()],
        low: vec![0; nodes.len()],
        on_stack: vec![false; nodes.len()],
        stack: Vec::new(),
        counter: 0,
        found: Vec::new(),
    };
    for v in 0..nodes.len() {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    let mut found: Vec<BTreeSet<N>> = t
        .found
        .into_iter()
        .map(|c| c.into_iter().map(|i| nodes[i].clone()).collect())
        .collect();
    found.sort();
    found
}

/// The directory a file's child modules live in.
fn module_dir(file: &Path) -> PathBuf {
    let name = file.file_name().unwrap().to_str().unwrap();
    if matches!(name, "lib.rs" | "main.rs" | "mod.rs") {
        file.parent().unwrap().to_path_buf()
    } else {
        file.with_extension("")
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Path,
    Punct(char),
}

/// The tokens of Rust source that matter here, with their line: identifiers, `::` and
/// single punctuation; comments, strings and character literals are dropped.
fn tokens(text: &str) -> Vec<(usize, Tok)> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == 'r'
            && (at(i + 1) == '"' || (at(i + 1) == '#' && matches!(at(i + 2), '#' | '"')))
        {
            // A raw string: r"…", r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while at(j) == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            loop {
                if j >= chars.len() {
                    break;
                }
                if chars[j] == '"' && (0..hashes).all(|h| at(j + 1 + h) == '#') {
                    j += 1 + hashes;
                    break;
                }
                if chars[j] == '\n' {
                    line += 1;
                }
                j += 1;
            }
            i = j;
        } else if c == 'b' && at(i + 1) == '"' {
            i += 1;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if at(i + 1) == '\\' {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
            }
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push((line, Tok::Ident(chars[start..i].iter().collect())));
        } else if c == ':' && at(i + 1) == ':' {
            out.push((line, Tok::Path));
            i += 2;
        } else {
            out.push((line, Tok::Punct(c)));
            i += 1;
        }
    }
    out
}

fn is_punct(t: Option<&(usize, Tok)>, c: char) -> bool {
    matches!(t, Some((_, Tok::Punct(p))) if *p == c)
}

fn ident(t: Option<&(usize, Tok)>) -> Option<&str> {
    match t {
        Some((_, Tok::Ident(s))) => Some(s),
        _ => None,
    }
}

/// The tokens without the items under `#[cfg(test)]`.
fn without_tests(toks: Vec<(usize, Tok)>) -> Vec<(usize, Tok)> {
    let mut out = Vec::new();
    let mut i = 0;
    let cfg_test = [
        Tok::Punct('#'),
        Tok::Punct('['),
        Tok::Ident("cfg".into()),
        Tok::Punct('('),
        Tok::Ident("test".into()),
        Tok::Punct(')'),
        Tok::Punct(']'),
    ];
    while i < toks.len() {
        let here = toks[i..].iter().take(cfg_test.len()).map(|(_, t)| t);
        if here.eq(cfg_test.iter()) {
            i += cfg_test.len();
            // The item: up to a `;` outside any bracket, or the end of its first block.
            let mut depth = 0i32;
            let mut braced = false;
            while i < toks.len() {
                match &toks[i].1 {
                    Tok::Punct('(' | '[') => depth += 1,
                    Tok::Punct(')' | ']') => depth -= 1,
                    Tok::Punct('{') => {
                        depth += 1;
                        braced = true;
                    }
                    Tok::Punct('}') => {
                        depth -= 1;
                        if braced && depth == 0 {
                            i += 1;
                            break;
                        }
                    }
                    Tok::Punct(';') if depth == 0 && !braced => {
                        i += 1;
                        break;
                    }
                    _ => {}
                }
                i += 1;
            }
        } else {
            out.push(toks[i].clone());
            i += 1;
        }
    }
    out
}

/// `mod name;` declarations (modules in files of their own).
fn child_modules(toks: &[(usize, Tok)]) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..toks.len() {
        if ident(toks.get(i)) == Some("mod") && is_punct(toks.get(i + 2), ';') {
            if let Some(name) = ident(toks.get(i + 1)) {
                out.push(name.to_string());
            }
        }
    }
    out
}

/// The names a file's `use` declarations take from other crates (`use slotpool_config as
/// config;`, `use std::sync::Arc;`): a path through one of them leaves the crate.
fn foreign_names(toks: &[(usize, Tok)], children: &[String]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for i in 0..toks.len() {
        if ident(toks.get(i)) != Some("use") {
            continue;
        }
        let mut end = i + 1;
        while end < toks.len() && !is_punct(toks.get(end), ';') {
            end += 1;
        }
        let mut leaves = Vec::new();
        use_tree(&toks[i + 1..end], &mut Vec::new(), &mut leaves);
        for (path, name) in leaves {
            let local = matches!(path[0].as_str(), "crate" | "self" | "super")
                || children.contains(&path[0]);
            if !local {
                out.insert(name);
            }
        }
    }
    out
}

/// Every path that may name a module of this crate, with its line: the leaves of `use`
/// trees, and paths in the code that start with `crate`, `super`, `self` or a child
/// module.
fn named_paths(toks: &[(usize, Tok)], children: &[String]) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if ident(toks.get(i)) == Some("use") {
            let start = i + 1;
            let mut end = start;
            while end < toks.len() && !is_punct(toks.get(end), ';') {
                end += 1;
            }
            let line = toks[i].0;
            let mut leaves = Vec::new();
            use_tree(&toks[start..end], &mut Vec::new(), &mut leaves);
            out.extend(leaves.into_iter().map(|(path, _)| (line, path)));
            i = end + 1;
            continue;
        }
        let starts_path = match ident(toks.get(i)) {
            Some("crate" | "super" | "self") => true,
            Some(name) => {
                children.iter().any(|c| c == name)
                    && matches!(toks.get(i + 1), Some((_, Tok::Path)))
            }
            None => false,
        };
        let after_path = matches!(
            i.checked_sub(1).and_then(|p| toks.get(p)),
            Some((_, Tok::Path))
        );
        if starts_path && !after_path {
            let line = toks[i].0;
            let mut segments = vec![ident(toks.get(i)).unwrap().to_string()];
            let mut j = i + 1;
            while matches!(toks.get(j), Some((_, Tok::Path))) {
                match ident(toks.get(j + 1)) {
                    Some(seg) => {
                        segments.push(seg.to_string());
                        j += 2;
                    }
                    None => break,
                }
            }
            if segments.len() > 1 {
                out.push((line, segments));
            }
            i = j;
            continue;
        }
        i += 1;
    }
    out
}

/// The paths a `use` tree names, each with the name it brings into scope:
/// `a::{b::{self, C}, d as e, *}` gives `a::b` (b), `a::b::C` (C), `a::d` (e), `a` (*).
fn use_tree(toks: &[(usize, Tok)], prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
    let mut path = prefix.clone();
    let mut i = 0;
    while i < toks.len() {
        match &toks[i].1 {
            Tok::Ident(s) if s == "as" => {
                let name = ident(toks.get(i + 1)).unwrap_or("_").to_string();
                if path.len() > prefix.len() {
                    out.push((path, name));
                }
                return;
            }
            Tok::Ident(s) if s == "self" && path == *prefix && !prefix.is_empty() => {
                let name = prefix.last().cloned().unwrap_or_default();
                let alias = match (ident(toks.get(i + 1)), ident(toks.get(i + 2))) {
                    (Some("as"), Some(alias)) => alias.to_string(),
                    _ => name,
                };
                out.push((path, alias));
                return;
            }
            Tok::Ident(s) => path.push(s.clone()),
            Tok::Punct('*') => {
                if !path.is_empty() {
                    out.push((path, "*".into()));
                }
                return;
            }
            Tok::Punct('{') => {
                let mut depth = 0;
                let mut from = i + 1;
                for k in i + 1..toks.len() {
                    match toks[k].1 {
                        Tok::Punct('{') => depth += 1,
                        Tok::Punct('}') if depth == 0 => {
                            use_tree(&toks[from..k], &mut path.clone(), out);
                            return;
                        }
                        Tok::Punct('}') => depth -= 1,
                        Tok::Punct(',') if depth == 0 => {
                            use_tree(&toks[from..k], &mut path.clone(), out);
                            from = k + 1;
                        }
                        _ => {}
                    }
                }
                return;
            }
            _ => {}
        }
        i += 1;
    }
    if path.len() > prefix.len() {
        let name = path.last().cloned().unwrap_or_default();
        out.push((path, name));
    }
}
