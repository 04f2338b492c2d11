//! The engine's layers, checked: the top-level modules of `crates/engine/src` (files
//! and folders) are its layers, in the order docs/ARCHITECTURE.md's table "The
//! engine's layers (checked)" gives. Every module must be in the table once, may
//! import (`use crate::...` or a `crate::...` path) only from its own layer or lower
//! ones, and the imports must form no cycle. Unit-test modules (`#[cfg(...test...)]
//! mod ... { }`) and comments are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layer table: module -> layer number.
fn layers_from(doc: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    let start = doc
        .find("### The engine's layers (checked)")
        .expect("ARCHITECTURE.md has no \"The engine's layers (checked)\" section");
    for line in doc[start..].lines().skip(1) {
        if line.starts_with('#') {
            break;
        }
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        let Some(layer) = cols.get(1).and_then(|c| c.parse::<usize>().ok()) else {
            continue;
        };
        let names = cols.get(2).copied().unwrap_or("");
        for name in names.split('`').skip(1).step_by(2) {
            let old = out.insert(name.to_string(), layer);
            assert!(old.is_none(), "{name} is in the layer table twice");
        }
    }
    assert!(!out.is_empty(), "the layer table lists no module");
    out
}

/// The text of a module: its file, or every `.rs` file under its folder.
fn module_text(path: &Path) -> String {
    if path.is_file() {
        return std::fs::read_to_string(path).expect("read module");
    }
    let mut text = String::new();
    let mut dirs = vec![path.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&d)
            .expect("read dir")
            .map(|e| e.expect("entry").path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                text.push_str(&std::fs::read_to_string(&p).expect("read file"));
                text.push('\n');
            }
        }
    }
    text
}

/// `text` without comment lines and without `#[cfg(...test...)] mod name { ... }`.
fn production_code(text: &str) -> String {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut out = String::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("#[cfg(") {
        let attr_end = rest[at..].find(")]").map(|e| at + e + 2);
        let Some(attr_end) = attr_end else { break };
        let attr = &rest[at..attr_end];
        let after = rest[attr_end..].trim_start();
        let is_test_mod = attr.contains("test")
            && after.starts_with("mod ")
            && after
                .find(['{', ';'])
                .is_some_and(|i| after.as_bytes()[i] == b'{');
        if !is_test_mod {
            out.push_str(&rest[..attr_end]);
            rest = &rest[attr_end..];
            continue;
        }
        out.push_str(&rest[..at]);
        let body = &rest[attr_end..];
        let open = body.find('{').expect("test module body");
        let mut depth = 0usize;
        let mut end = None;
        for (i, c) in body[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(open + i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let end = end.expect("unbalanced braces in a test module");
        rest = &body[end..];
    }
    out.push_str(rest);
    out
}

/// The crate-level names `code` refers to: `crate::name` paths and the names of a
/// grouped `use crate::{a, b::c}`.
fn imports_of(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // Items at the group's top level: the first name of each.
            let mut depth = 0usize;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if c.is_whitespace() => {}
                    _ if item_start && depth == 0 => {
                        let name = ident(&group[i..]);
                        if !name.is_empty() {
                            out.insert(name);
                        }
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(after);
            if !name.is_empty() {
                out.insert(name);
            }
        }
        rest = after;
    }
    out
}

/// The engine's modules and what each imports from the others.
fn import_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut mods = BTreeMap::new();
    for e in std::fs::read_dir(src).expect("read src") {
        let p = e.expect("entry").path();
        let name = if p.is_dir() {
            p.file_name().expect("name").to_string_lossy().into_owned()
        } else if p.extension().is_some_and(|x| x == "rs") {
            p.file_stem().expect("stem").to_string_lossy().into_owned()
        } else {
            continue;
        };
        if name != "lib" {
            mods.insert(name, p);
        }
    }
    let names: BTreeSet<String> = mods.keys().cloned().collect();
    mods.iter()
        .map(|(m, p)| {
            let deps = imports_of(&production_code(&module_text(p)))
                .into_iter()
                .filter(|d| names.contains(d) && d != m)
                .collect();
            (m.clone(), deps)
        })
        .collect()
}

/// Everything wrong with `graph` against `layers`, in words.
fn violations(
    graph: &BTreeMap<String, BTreeSet<String>>,
    layers: &BTreeMap<String, usize>,
) -> Vec<String> {
    let mut out = Vec::new();
    for m in graph.keys() {
        if !layers.contains_key(m) {
            out.push(format!("module {m} is not in the layer table"));
        }
    }
    for m in layers.keys() {
        if !graph.contains_key(m) {
            out.push(format!("the layer table lists {m}, which is no module"));
        }
    }
    for (m, deps) in graph {
        let Some(&lm) = layers.get(m) else { continue };
        for d in deps {
            if let Some(&ld) = layers.get(d) {
                if ld > lm {
                    out.push(format!(
                        "{m} (layer {lm}) imports {d}, of the higher layer {ld}"
                    ));
                }
            }
        }
    }
    // Cycles: a depth-first search that meets a module on its own path.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<&'a str, bool>,
        path: &mut Vec<&'a str>,
        out: &mut Vec<String>,
    ) {
        match state.get(m) {
            Some(true) => return,
            Some(false) => {
                let from = path.iter().position(|p| *p == m).unwrap_or(0);
                out.push(format!(
                    "import cycle: {} -> {m}",
                    path[from..].join(" -> ")
                ));
                return;
            }
            None => {}
        }
        state.insert(m, false);
        path.push(m);
        for d in graph.get(m).into_iter().flatten() {
            visit(d, graph, state, path, out);
        }
        path.pop();
        state.insert(m, true);
    }
    let mut state = BTreeMap::new();
    for m in graph.keys() {
        visit(m, graph, &mut state, &mut Vec::new(), &mut out);
    }
    out
}

#[test]
fn the_engine_s_imports_follow_its_layers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("../../docs/ARCHITECTURE.md"))
        .expect("read docs/ARCHITECTURE.md");
    let layers = layers_from(&doc);
    let graph = import_graph(&root.join("src"));
    assert!(
        graph.len() > 20 && graph.values().map(BTreeSet::len).sum::<usize>() > 50,
        "the scan found too little: {graph:?}"
    );
    let v = violations(&graph, &layers);
    assert!(v.is_empty(), "layer check:\n{}", v.join("\n"));
}

/// The checker itself: it reads grouped and plain paths, leaves test modules and
/// comments out, and reports an upward import, a cycle and a missing module.
#[test]
fn the_checker_sees_what_it_must() {
    let code = "use crate::{a, b::{c, d}, e::f as g};\n\
                // crate::commented\n\
                fn x() { crate::h::y(); }\n\
                #[cfg(all(test, debug_assertions))]\n\
                mod tests { fn t() { crate::tested::z(); { } } }\n\
                fn after() { crate::i::j }\n";
    let got = imports_of(&production_code(code));
    let want: BTreeSet<String> = ["a", "b", "e", "h", "i"].map(String::from).into();
    assert_eq!(got, want);
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("low", vec!["high"]),
        ("high", vec!["low"]),
        ("stray", vec![]),
    ]
    .into_iter()
    .map(|(m, d)| (m.to_string(), d.into_iter().map(String::from).collect()))
    .collect();
    let layers: BTreeMap<String, usize> = [("low".to_string(), 0), ("high".to_string(), 1)].into();
    let v = violations(&graph, &layers).join("\n");
    assert!(v.contains("low (layer 0) imports high"), "{v}");
    assert!(v.contains("import cycle"), "{v}");
    assert!(v.contains("stray is not in the layer table"), "{v}");
    let doc = "### The engine's layers (checked)\n\n| layer | modules |\n|---|---|\n\
               | 0 | `low` | x |\n| 1 | `high`, `other` | y |\n\n## Next\n| 2 | `no` |\n";
    let l = layers_from(doc);
    assert_eq!(l.get("other"), Some(&1));
    assert_eq!(l.get("no"), None);
}
